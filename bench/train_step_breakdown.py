#!/usr/bin/env python3
"""bench/train_step_breakdown.py — where the training step of examples/train_moe_lm.py spends its
time, for the gmoe model and the PyTorch model, on the same configuration (the example's flags).

Per model, timed with CUDA events (median of --iters, after warm-up), in ms:
  step       the whole training step as the example runs it (captured in a CUDA graph and replayed,
             unless --no-cuda-graph)
  moe        forward + backward of the model's MoE blocks alone (router, permute, experts, combine,
             the aux losses), on the hidden states they see in the step, eagerly (the torch model's
             blocks compiled as in the example)
  optimizer  the update alone: gradients copied to the float32 masters, clipping, AdamW, the
             masters copied back
  rest       step - moe - optimizer: attention, norms, embedding, head, and what the graph saves
The summary gives each part's share of the step and gmoe's speed-up per part: the step's speed-up
is bounded by the MoE blocks' share of it (Amdahl), which this measures.

    python3 bench/train_step_breakdown.py [--iters N] [example flags, e.g. --preset gpu-moe --batch 32] --json out.json

On the CPU it runs (eagerly, the tiny preset) so that the script is tested in CI; its times mean
nothing there.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import train_moe_lm as ex  # noqa: E402  (the example's model, trainer and configuration)


def timer(cuda: bool):
    """(start, stop) → a function giving the ms between them: CUDA events on the GPU, wall clock on the CPU."""
    if cuda:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def start():
            a.record()

        def stop():
            b.record()
            b.synchronize()
            return a.elapsed_time(b)
        return start, stop
    t = [0.0]

    def start_cpu():
        t[0] = time.perf_counter()

    def stop_cpu():
        return 1e3 * (time.perf_counter() - t[0])
    return start_cpu, stop_cpu


def median_ms(fn, iters: int, warmup: int, cuda: bool) -> float:
    for _ in range(warmup):
        fn()
    start, stop = timer(cuda)
    out = []
    for _ in range(iters):
        start()
        fn()
        out.append(stop())
    return statistics.median(out)


def breakdown(impl: str, cfg, init, corpus, iters: int, warmup: int) -> dict:
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    if cuda:
        # The previous model goes first: at the gpu-moe preset each model's weights, masters and
        # moments alone are 12 GiB or more.
        base_memory = ex.release_previous_model(device)
    torch.manual_seed(cfg.seed)
    model = ex.build_model(impl, cfg, device, cfg.torch_dtype)
    trainer = ex.Trainer(model, cfg, ex.from_hf(init, impl, cfg))
    if cuda and cfg.compile:
        model.compile_parts(moe_too=(impl == "torch"))
    data = corpus.to(device)
    window = torch.arange(cfg.seq_len + 1, device=device)
    starts = ex.batch_starts(corpus.numel(), cfg, 0, warmup + iters + 1).to(device)
    tokens = data[starts[0][:, None] + window].long()

    # The step as the example runs it, captured first: an eager step on the default stream before
    # the capture would leave AccumulateGrad nodes on that stream, which the capture cannot join.
    if cuda and cfg.cuda_graph:
        trainer.capture(tokens)
    step_ms = median_ms(lambda: trainer.step(tokens), iters, warmup, cuda)
    peak_mib = (torch.cuda.max_memory_allocated(device) - base_memory) / 2**20 if cuda else None
    trainer.graph = None
    if cuda:
        torch.cuda.empty_cache()  # the graph's pool, before the eager steps below make their own activations

    # The MoE blocks' inputs in a step: recorded by a pre-hook during one eager step.
    inputs = {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach().clone()))
             for i, layer in enumerate(model.model.layers)]
    trainer.step(tokens)
    for h in hooks:
        h.remove()

    mlps = [layer.mlp for layer in model.model.layers]
    xs = [inputs[i].requires_grad_() for i in range(len(mlps))]
    dys = [torch.randn_like(x) for x in xs]

    def moe_only():
        model.zero_grad(set_to_none=True)
        for mlp, x, dy in zip(mlps, xs, dys):
            y = mlp(x)
            loss = (y.float() * dy).sum()
            if mlp.aux_loss is not None:
                loss = loss + mlp.aux_loss
            loss.backward()
            if cfg.delay_wgrad:
                mlp.backward_dw()
    moe_ms = median_ms(moe_only, iters, warmup, cuda)

    # Gradients of every parameter, as after a step's backward, then the update alone.
    model.zero_grad(set_to_none=True)
    ce, aux = model.loss(tokens)
    (ce if aux is None else ce + aux).backward()

    opt_ms = median_ms(trainer.update, iters, warmup, cuda)
    rest = step_ms - moe_ms - opt_ms
    return dict(impl=impl, step_ms=step_ms, moe_ms=moe_ms, optimizer_ms=opt_ms, rest_ms=rest,
                tokens_per_s=cfg.batch * cfg.seq_len / (step_ms / 1e3), peak_mib=peak_mib,
                optimizer="AdamW fused" if trainer.fused else "AdamW foreach")


def summary(cfg, rows) -> str:
    by = {r["impl"]: r for r in rows}
    lines = [f"# Training-step breakdown ({cfg.device}, {cfg.dtype}; {cfg.layers} layers, hidden {cfg.hidden}, "
             f"{cfg.experts} experts top-{cfg.top_k}, ffn {cfg.ffn}, batch {cfg.batch} x {cfg.seq_len}; "
             f"MoE blocks {100 * ex.moe_flop_share(cfg):.0f}% of the matmul FLOPs; {rows[0]['optimizer']})", "",
             "| model | step ms | MoE blocks ms | optimizer ms | rest ms | MoE share of the step | tokens/s | "
             "step peak MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}"
        lines.append(f"| {r['impl']} | {r['step_ms']:.2f} | {r['moe_ms']:.2f} | {r['optimizer_ms']:.2f} | "
                     f"{r['rest_ms']:.2f} | {100 * r['moe_ms'] / r['step_ms']:.0f}% | {r['tokens_per_s']:,.0f} | "
                     f"{peak} |")
    if "gmoe" in by and "torch" in by:
        g, t = by["gmoe"], by["torch"]
        lines += ["", "torch / gmoe: " + ", ".join(
            f"{k[:-3]} {t[k] / g[k]:.2f}x" for k in ("step_ms", "moe_ms", "optimizer_ms", "rest_ms") if g[k] > 0),
            f"Bound on the step's speed-up with everything but the MoE blocks equal (Amdahl): "
            f"{t['step_ms'] / (t['step_ms'] - t['moe_ms'] + g['moe_ms']):.2f}x",
            f"gmoe trains {g['tokens_per_s'] / t['tokens_per_s']:.2f}x the tokens/s of the PyTorch model "
            f"(issue 44's target: >= 1.2x) at a configuration where the MoE blocks are "
            f"{100 * g['moe_ms'] / g['step_ms']:.0f}% of gmoe's step ({100 * t['moe_ms'] / t['step_ms']:.0f}% of "
            f"the PyTorch model's)"]
    return "\n".join(lines)


#: The configuration a train row carries: the example's fields that change the step's time.
CONFIG_FIELDS = ("layers", "hidden", "heads", "experts", "top_k", "ffn", "activation", "seq_len", "batch", "recipe",
                 "delay_wgrad", "weight_layout", "dtype", "cuda_graph", "compile")


def results_file(cfg, rows) -> dict:
    """The rows in the results format (docs/benchmarks.md): kind "train", one row per model and part
    (pass step, moe, optimizer, rest), merged into bench/results/<gpu>.json by bench/report.py. Each
    row carries the configuration (CONFIG_FIELDS and the optimizer), the MoE blocks' share of its
    model's step (moe_share: moe ms / step ms) and of the matmul FLOPs; the step row the tokens/s
    and the step's peak memory."""
    case = (f"train_moe_lm/{cfg.layers}x{cfg.hidden}_e{cfg.experts}_top{cfg.top_k}_ffn{cfg.ffn}"
            f"_b{cfg.batch}x{cfg.seq_len}" + (f"_{cfg.recipe}" if cfg.recipe else "")
            + ("_dw" if cfg.delay_wgrad else ""))
    out = []
    for r in rows:
        config = {k: getattr(cfg, k) for k in CONFIG_FIELDS}
        config["optimizer"] = r["optimizer"]
        for part in ("step", "moe", "optimizer", "rest"):
            row = {"case": case, "kind": "train", "pass": part, "impl": r["impl"], "dtype": cfg.dtype,
                   "ms": r[f"{part}_ms"], "tflops": None, "correct": None, "config": config,
                   "moe_share": r["moe_ms"] / r["step_ms"], "moe_flop_share": ex.moe_flop_share(cfg)}
            if part == "step":
                row["tokens_per_s"] = r["tokens_per_s"]
                if r["peak_mib"] is not None:
                    row["peak_mib"] = r["peak_mib"]
            out.append(row)
    cuda = cfg.device.startswith("cuda")
    return dict(gpu=torch.cuda.get_device_name() if cuda else "cpu", commit=os.environ.get("GMOE_COMMIT", ""),
                date=time.strftime("%Y-%m-%d"), suite="train_moe_lm", torch=torch.__version__, rows=out)


def main(argv=None):
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--markdown", help="write the summary here")
    own, rest = ap.parse_known_args(argv)
    cfg = ex.parse_args(rest)
    ex.check_config(cfg)
    corpus = ex.load_corpus()
    init = ex.initial_state(cfg)
    rows = [breakdown(impl, cfg, init, corpus, own.iters, own.warmup) for impl in cfg.impls]
    text = summary(cfg, rows)
    print(text)
    if own.json:
        with open(own.json, "w") as f:
            json.dump(results_file(cfg, rows), f, indent=1)
    if own.markdown:
        with open(own.markdown, "w") as f:
            f.write(text + "\n")
    return rows


if __name__ == "__main__":
    main()

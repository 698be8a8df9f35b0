#!/usr/bin/env python3
"""bench/torch_moe_baseline.py — the MoE block in PyTorch, written the way Megatron writes it, and
gmoe.MoELayer through the PyTorch package, on the moe cases of a gmoe suite, in one session.

The block, per case (tokens T, hidden H, ffn F, E experts, top_k, activation; bf16):
    logits = linear(x, W_r)                                   router [T, E] (bf16; --router-dtype fp32)
    probs, ids = topk(softmax(logits, f32), top_k); probs /= probs.sum(-1)   (renormalised)
    order = argsort(ids.flatten(), stable); src = order // top_k             sort-based permute
    xp = x[src];  counts = bincount(ids, E);  offs = cumsum(counts)          offsets on the device
    h = _grouped_mm(xp, W1ᵀ, offs); z = act(h); yp = _grouped_mm(z, W2ᵀ, offs)
    out = zeros(f32).index_add_(0, src, yp · probs[order]).to(bf16)          weighted combine
  W1 [E, 2·F, H] with outputs [gate | up], W2 [E, H, F], the case's activation (swiglu, or gpt-oss's
  clamped_swiglu). Nothing reads the counts on the host.
impls:
  torch          the block, eager
  torch_compile  the same under torch.compile (compiled before timing; a compile failure is recorded
                 under "errors" and the run goes on)
  gmoe_torch     gmoe.MoELayer(E, H, F, top_k, activation=..., normalize_topk=True,
                 recompute_activation=True, as gmoe-bench's C++ MoELayer) with the same
                 weights (its parameters of shapes [E, H], [E, 2F, H], [E, H, F] share the block's
                 storage) when the gmoe package is importable and has MoELayer; else the summary says
                 it is absent. Its output is checked against the eager block's with a float32 router,
                 as the module computes its logits (relative Frobenius error below 2e-2: "correct").
                 It runs with the module's defaults: regather_expert_input (the permuted rows are
                 not kept for backward but gathered again there), as gmoe-bench's impl gmoe.
  gmoe_torch_keep_input  the same module with regather_expert_input = False (keeps the permuted
                 rows, as gmoe-bench's gmoe_keep_input), when the package has the option.

The routing of a case: logits = logit_std · N(0, 1) + logit_bias[e], as gmoe-bench draws them; here
through the router itself: x's first feature is the constant 1, W_r's first column logit_bias, the
rest of W_r N(0, logit_std² / (H - 1)) (so that the rest of each logit is about N(0, logit_std²)).

Timed (CUDA events; CPU: wall clock): `forward` (with autograd recording) and `forward_backward`
(forward, then torch.autograd.grad of a random dout for x, W_r, W1, W2, or the module's parameters),
warm-up, --warm-ms of untimed back-to-back work, median of --iters. FLOPs: the expert GEMMs only
(docs/benchmarks.md: 2·T·k·H·2F + 2·T·k·F·H forward; forward_backward 3×). Memory, per impl:
  saved_bytes_per_token  the bytes of every tensor autograd saves in forward
                         (torch.autograd.graph.saved_tensors_hooks), deduplicated by storage,
                         parameters excluded, x included, divided by T
  kept_bytes_per_token   CUDA: the allocator's bytes live after forward minus before, less the
                         output, plus x (gmoe-bench's definition, for every impl alike: it also sees
                         what an extension keeps outside autograd's saved tensors); CPU: saved_bytes
  peak_mib               CUDA: torch.cuda.max_memory_allocated over one forward + backward, less
                         what was allocated before it (inputs and weights)
Writes rows in the docs/benchmarks.md results format (kind "moe"). Runs on the CPU too (slowly: use
a small suite such as tests/bench/moe_suite.json); --dry-run lists the cases without torch.
"""
import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time

torch = None  # imported in main (not needed by --dry-run)


def expert_flops(case):
    """The expert GEMMs of one forward (gated activations: FC1 has 2·ffn outputs)."""
    rows = case["tokens"] * case["top_k"]
    return 2.0 * rows * case["hidden"] * 2 * case["ffn"] + 2.0 * rows * case["ffn"] * case["hidden"]


def swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


def clamped_swiglu(gate, up):
    gate = gate.clamp(max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


ACTIVATIONS = {"swiglu": swiglu, "clamped_swiglu": clamped_swiglu}


def moe_block(x, w_r, w1, w2, top_k, act, router_dtype=None):
    """The MoE block as Megatron writes it (see the module docstring); router_dtype: the router
    linear's (None: x's; torch.float32: Megatron's --moe-router-dtype fp32, as gmoe.MoELayer)."""
    E = w1.shape[0]
    rd = router_dtype or x.dtype
    logits = torch.nn.functional.linear(x.to(rd), w_r.to(rd))
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    probs, ids = torch.topk(scores, top_k, dim=-1)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    src = order // top_k
    xp = x.index_select(0, src)
    offs = torch.cumsum(torch.bincount(flat, minlength=E), 0, dtype=torch.int32)
    h = torch._grouped_mm(xp, w1.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    yp = torch._grouped_mm(ACTIVATIONS[act](gate, up), w2.transpose(-2, -1), offs=offs)
    weighted = yp * probs.reshape(-1).index_select(0, order).unsqueeze(-1).to(yp.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, src, weighted.float())
    return out.to(x.dtype)


_compiled = {}


def compiled_block(top_k, act, router_dtype):
    # One compiled function per (top_k, activation, router dtype); a new shape recompiles
    # (dynamic=False).
    key = (top_k, act, router_dtype)
    if key not in _compiled:
        _compiled[key] = torch.compile(lambda x, w_r, w1, w2: moe_block(x, w_r, w1, w2, top_k, act, router_dtype),
                                       dynamic=False)
    return _compiled[key]


def synchronize(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, dev, warmup, iters, warm_ms):
    if dev == "cuda":
        import torch_baseline as tb  # the same timing as the other baselines (CUDA events)
        tb.torch = torch
        return tb.time_ms(fn, warmup, iters, warm_ms)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def saved_bytes(forward, params):
    """Bytes of the tensors autograd saves during forward(): by storage, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes() > 0:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(seen.values())


def kept_and_peak(forward, x, dout, grad_inputs, dev):
    """CUDA: (bytes live after forward minus before, less the output, plus x; peak MiB of one
    forward + backward above what was allocated before). CPU: (None, None)."""
    if dev != "cuda":
        return None, None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = forward()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes() + x.untyped_storage().nbytes()
    grads = torch.autograd.grad(out, grad_inputs, grad_outputs=dout)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    del out, grads
    return kept, peak


def make_inputs(case, dev, seed=0):
    T, H, F, E = case["tokens"], case["hidden"], case["ffn"], case["E"]
    bias = case.get("logit_bias") or [0.0] * E
    std = case.get("logit_std", 1.0)
    g = torch.Generator(device=dev).manual_seed(seed)
    dt = torch.bfloat16

    def randn(*shape, scale=1.0):  # drawn on the device: a DeepSeek-V3 case has 11G weights
        return torch.randn(*shape, generator=g, device=dev, dtype=dt).mul_(scale)

    x = randn(T, H)
    x[:, 0] = 1.0  # carries the routing's per-expert bias through the router
    w_r = randn(E, H, scale=std / math.sqrt(max(H - 1, 1)))
    w_r[:, 0] = torch.tensor(bias, dtype=torch.float32).to(dev, dt)
    w1 = randn(E, 2 * F, H, scale=H ** -0.5)
    w2 = randn(E, H, F, scale=F ** -0.5)
    dout = randn(T, H)
    return x.requires_grad_(), w_r.requires_grad_(), w1.requires_grad_(), w2.requires_grad_(), dout


def gmoe_module(case, w_r, w1, w2, dev):
    """gmoe.MoELayer with the block's weights (shared storage), or (None, reason)."""
    try:
        import gmoe
    except Exception as e:  # noqa: BLE001 (any import failure means: not available here)
        return None, f"the gmoe package is not importable ({type(e).__name__}: {e})"
    if not hasattr(gmoe, "MoELayer"):
        return None, "the gmoe package has no MoELayer"
    E, H, F, k = case["E"], case["hidden"], case["ffn"], case["top_k"]
    want = {"activation": case.get("activation", "swiglu"), "device": dev, "dtype": torch.bfloat16,
            "score_func": "softmax", "normalize_topk": True, "bias": False,
            # as gmoe-bench's MoELayer (tools/bench/moe_common.cpp): the experts recompute their activation
            "recompute_activation": True}
    try:
        accepted = inspect.signature(gmoe.MoELayer).parameters
        kwargs = {n: v for n, v in want.items() if n in accepted or any(
            p.kind == inspect.Parameter.VAR_KEYWORD for p in accepted.values())}
        m = gmoe.MoELayer(E, H, F, k, **kwargs)
        m = m.to(device=dev, dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        return None, f"gmoe.MoELayer({E}, {H}, {F}, {k}, ...) failed: {type(e).__name__}: {e}"
    shared = []
    for name, p in m.named_parameters():
        for src in (w_r, w1, w2):
            if tuple(p.shape) == tuple(src.shape) and all(src is not s for s in shared):
                p.data = src.detach()  # the same storage: the same weights, no second copy
                shared.append(src)
                break
    if len(shared) < 3:
        return m, "its parameters do not all match the block's shapes [E, H], [E, 2F, H], [E, H, F]: " \
                  "not checked against the block"
    return m, None


def relative_error(got, ref):
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def case_rows(case, args, dev, errors, notes):
    k, act = case["top_k"], case.get("activation", "swiglu")
    if act not in ACTIVATIONS:
        errors.append({"case": case["name"], "impl": "torch", "error": f"unknown activation '{act}'"})
        return []
    if k > case["E"]:
        errors.append({"case": case["name"], "impl": "torch", "error": f"top_k {k} > E {case['E']}"})
        return []
    x, w_r, w1, w2, dout = make_inputs(case, dev)
    weights = [w_r, w1, w2]
    flops = expert_flops(case)
    T = max(case["tokens"], 1)
    rd = torch.float32 if args.router_dtype == "fp32" else None
    impls = [("torch", lambda: moe_block(x, w_r, w1, w2, k, act, rd), weights)]
    if not args.no_compile:
        fn = compiled_block(k, act, rd)
        impls.append(("torch_compile", lambda: fn(x, w_r, w1, w2), weights))
    module_check = None
    if not args.no_module:
        m, why = gmoe_module(case, w_r, w1, w2, dev)
        if m is None:
            notes.add(f"gmoe_torch: absent ({why})")
        else:
            params = [p for p in m.parameters() if p.requires_grad]
            impls.append(("gmoe_torch", lambda: m(x), params))
            if hasattr(m, "regather_expert_input"):
                def keep_input(m=m):
                    m.regather_expert_input = False  # read by forward only: backward uses what it saved
                    try:
                        return m(x)
                    finally:
                        m.regather_expert_input = True
                impls.append(("gmoe_torch_keep_input", keep_input, params))
            if why:
                notes.add(f"gmoe_torch: {why}")
            else:
                try:
                    with torch.no_grad():
                        # float32 logits, as the module computes them: the same routing
                        err = relative_error(m(x), moe_block(x, w_r, w1, w2, k, act, torch.float32))
                    module_check = (err < 2e-2, f"out: relative Frobenius error {err:.3g} against the eager block "
                                                "(float32 router)")
                except Exception as e:  # noqa: BLE001 (its timing below records the same failure)
                    module_check = (False, f"out: {type(e).__name__}: {e}")
                if not module_check[0]:
                    errors.append({"case": case["name"], "impl": "gmoe_torch", "error": module_check[1][:2000]})
    out = []
    for impl, forward, params in impls:
        grad_inputs = [x] + params

        def forward_backward(forward=forward, grad_inputs=grad_inputs):
            torch.autograd.grad(forward(), grad_inputs, grad_outputs=dout)

        try:
            t0 = time.time()
            for _ in range(2):  # torch.compile compiles forward and backward here, before timing
                forward_backward()
            synchronize(dev)
            if impl == "torch_compile":
                print(f"torch: {case['name']} compiled in {time.time() - t0:.1f} s", flush=True)
            saved = saved_bytes(forward, params)
            kept, peak = kept_and_peak(forward, x, dout, grad_inputs, dev)
            for pass_name, run, pass_flops in (("forward", forward, flops),
                                               ("forward_backward", forward_backward, 3 * flops)):
                ms = time_ms(run, dev, args.warmup, args.iters, args.warm_ms if dev == "cuda" else 0)
                r = {"case": case["name"], "kind": "moe", "pass": pass_name, "impl": impl, "dtype": "bf16", "ms": ms,
                     "tflops": pass_flops / (ms * 1e-3) / 1e12, "correct": None,
                     "saved_bytes_per_token": saved / T,
                     "kept_bytes_per_token": (kept if kept is not None else saved) / T}
                if peak is not None and pass_name == "forward_backward":
                    r["peak_mib"] = peak
                if impl.startswith("gmoe_torch") and module_check:
                    r["correct"], r["note"] = module_check
                out.append(r)
        except Exception as e:  # a failing implementation is recorded, the run goes on
            msg = f"{type(e).__name__}: {e}"
            print(f"{impl} {case['name']}: {msg}", file=sys.stderr)
            errors.append({"case": case["name"], "impl": impl, "error": msg[:2000]})
    del x, w_r, w1, w2, dout, impls
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def summary(rows, notes):
    by = {(r["case"], r["pass"], r["impl"]): r for r in rows}
    fmt = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = ["| case | gmoe_torch ms | torch ms | torch_compile ms | compiled / gmoe_torch | kept B/token gmoe_torch | "
             "torch | torch_compile | peak MiB gmoe_torch | torch | torch_compile |",
             "|---|" + "---:|" * 10]
    for case in dict.fromkeys(r["case"] for r in rows):
        get = lambda impl, key: (by.get((case, "forward_backward", impl)) or {}).get(key)  # noqa: E731
        g, tc = get("gmoe_torch", "ms"), get("torch_compile", "ms")
        lines.append(f"| {case} | {fmt(g)} | {fmt(get('torch', 'ms'))} | {fmt(tc)} | "
                     f"{'-' if g is None or tc is None else f'{tc / g:.2f}x'} | "
                     + " | ".join(fmt(get(i, "kept_bytes_per_token"), 0) for i in ("gmoe_torch", "torch", "torch_compile"))
                     + " | " + " | ".join(fmt(get(i, "peak_mib"), 1) for i in ("gmoe_torch", "torch", "torch_compile"))
                     + " |")
    return "\n".join(lines + sorted(notes))


def main():
    global torch
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="bench/suites/public.json")
    ap.add_argument("--json", help="output file (required unless --dry-run)")
    ap.add_argument("--case", default="", help="only cases whose name contains this")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="auto: CUDA when available, else the CPU (a smoke run: its times are not figures)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--no-module", action="store_true", help="skip gmoe.MoELayer")
    ap.add_argument("--router-dtype", choices=["bf16", "fp32"], default="bf16",
                    help="the PyTorch block's router linear: bf16 (Megatron's default: the input's dtype) or fp32 "
                         "(Megatron's --moe-router-dtype fp32, as gmoe.MoELayer computes its logits)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--warm-ms", type=float, default=1000.0,
                    help="CUDA: ms of back-to-back untimed work before each timing (as gmoe-bench's --warm-ms)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="print the cases, then exit")
    args = ap.parse_args()
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    if not args.dry_run and not args.json:
        ap.error("--json is required (unless --dry-run)")
    with open(args.suite) as f:
        suite = json.load(f)
    cases = [c for c in suite["cases"] if c["kind"] == "moe" and (not args.case or args.case in c["name"])]
    if args.dry_run:
        for c in cases:
            print(f"{c['name']:28s} tokens {c['tokens']}, top-{c['top_k']} of E {c['E']}, hidden {c['hidden']}, "
                  f"ffn {c['ffn']}, {c.get('activation', 'swiglu')}, {c['routing']} routing; "
                  f"{expert_flops(c) / 1e9:.0f} GFLOP forward")
        print(f"{len(cases)} cases")
        return 0
    import torch as torch_module
    torch = torch_module
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    dev = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    rows, errors, notes = [], [], set()
    for case in cases:
        t0 = time.time()
        rows += case_rows(case, args, dev, errors, notes)
        print(f"torch moe: {case['name']} done ({time.time() - t0:.1f} s)", flush=True)
    result = {"gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
              "suite": os.path.basename(args.suite).split(".")[0], "date": time.strftime("%Y-%m-%d"),
              "torch": torch.__version__, "rows": rows, "errors": errors, "notes": sorted(notes)}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(summary(rows, notes))
    return 1 if any(r.get("correct") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

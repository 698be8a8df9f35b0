#!/usr/bin/env python3
"""bench/torch_module_bench.py — gmoe.GroupedMLP through the PyTorch package, against the C++ layer
and against the same MLP written in PyTorch, on the mlp cases of a suite, in one GPU session.

Per case (same shapes and counts as gmoe-bench), timed `forward` (with autograd recording) and
`forward_backward` (forward, then torch.autograd.grad of a random dy for x and the weights):
  gmoe_torch     gmoe.GroupedMLP (bf16, stacked weights [E, 2·ffn, hidden] / [E, hidden, ffn], no
                 bias, FC1 outputs [gate | up], the case's activation), through torch.ops.gmoe
  gmoe           the C++ GroupedMLP: gmoe-bench --mode mlp on the same case, run from here
                 (--gmoe-bench PATH; skipped when not given)
  torch          torch._grouped_mm → activation → torch._grouped_mm (bench/torch_baseline.py's
                 composition), eager
  torch_compile  the same under torch.compile
Correctness first: gmoe_torch's output against the torch composition (relative Frobenius error
below 1e-2 sets "correct"). Then warm-up, --warm-ms of untimed back-to-back work, CUDA events, the
median of --iters runs. The summary prints gmoe_torch / gmoe (the issue's target: within 3%) and
the speed-ups over torch.

It also measures the package's per-call host overhead at tiny shapes (CUDA: 8 experts, 64 rows,
width 64, bf16; CPU: 2 experts, 4 rows, width 8, float32: the kernels' time is small, so a loop of
calls is bound by the host path), in µs per call (impl
"gmoe_op_overhead" / "torch_op_overhead", field "us_per_call"), gmoe against torch doing the same:
  op_overhead                 grouped_bias_grad  vs  torch.sum over dim 0
  op_overhead/grouped_gemm    grouped_gemm_fprop vs  torch._grouped_mm (no gradient recorded)
  op_overhead/grouped_gemm_ag the same with x and w requiring grad (autograd records the op)
  op_overhead/mlp_forward     gmoe.GroupedMLP forward vs the torch composition (swiglu), recorded
  op_overhead/mlp_fwd_bwd     the same, forward then torch.autograd.grad of x and the weights
  op_overhead/mlp_fwd_bwd_main_grad  Megatron's step: the weight gradients added into main_grad
                              (DDP's mark set), torch adding its gradients into main_grads too
  op_overhead/mlp_fwd_bwd_delayed    the same with delay_wgrad_compute and backward_dw()
Each is the best of --overhead-repeats loops of --overhead-calls calls (gmoe and torch interleaved).
--overhead runs these rows alone, on the CPU too when there is no GPU (there the CPU backend's and
torch's CPU kernels are part of the figure: compare the gmoe and torch columns, not the CPU figures
with the GPU's).

Writes rows in the docs/benchmarks.md results format (--json), each marked "kind": "module". Needs
the gmoe package importable (pip install ., or PYTHONPATH=python after scripts/test_python.sh
--inplace --cuda).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_baseline as tb  # noqa: E402  (the torch composition and the timing helper, shared)

tb.torch = torch


def module_rows(case, args, errors):
    import gmoe

    E, rows, hidden, ffn = case["E"], case["rows"], case["hidden"], case["ffn"]
    act = case.get("activation", "swiglu")
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    m = gmoe.GroupedMLP(E, hidden, ffn, activation=act, bias=False, device=dev, dtype=dt)
    with torch.no_grad():  # the torch baseline's scaling, so both see the same magnitudes
        m.fc1.weight.copy_(torch.randn_like(m.fc1.weight) * hidden ** -0.5)
        m.fc2.weight.copy_(torch.randn_like(m.fc2.weight) * ffn ** -0.5)
    x = torch.randn(rows, hidden, device=dev, dtype=dt).requires_grad_()
    dy = torch.randn(rows, hidden, device=dev, dtype=dt)
    counts = torch.tensor(case["counts"], device=dev, dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    params = [m.fc1.weight, m.fc2.weight]
    flops = tb.mlp_flops(case)

    # correctness against the torch composition with the same weights
    with torch.no_grad():
        y = m(x, counts)
        y_ref = tb.MLP_FUNCTIONS[act](x, m.fc1.weight, m.fc2.weight, offs)
        err = ((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
    correct = err < 1e-2
    if not correct:
        errors.append({"case": case["name"], "impl": "gmoe_torch", "error": f"relative error {err:.3g}"})

    impls = [("gmoe_torch", lambda: m(x, counts), params)]
    w1 = m.fc1.weight.detach().clone().requires_grad_()
    w2 = m.fc2.weight.detach().clone().requires_grad_()
    impls.append(("torch", lambda: tb.MLP_FUNCTIONS[act](x, w1, w2, offs), [w1, w2]))
    if not args.no_compile:
        fn = tb.compiled_mlp(act)
        impls.append(("torch_compile", lambda: fn(x, w1, w2, offs), [w1, w2]))
    out = []
    for impl, forward, ws in impls:
        def forward_backward(forward=forward, ws=ws):
            torch.autograd.grad(forward(), [x] + ws, grad_outputs=dy)

        try:
            for _ in range(2):  # torch.compile compiles here, before timing
                forward_backward()
            torch.cuda.synchronize()
            for pass_name, run, pass_flops in (("forward", forward, flops),
                                               ("forward_backward", forward_backward, 3 * flops)):
                ms = tb.time_ms(run, args.warmup, args.iters, args.warm_ms)
                r = tb.row(case, pass_name, impl, ms, pass_flops)
                if impl == "gmoe_torch":
                    r["correct"] = correct
                out.append(r)
        except Exception as e:  # a failing baseline is recorded, the run goes on
            msg = f"{type(e).__name__}: {e}"
            print(f"{impl} {case['name']}: {msg}", file=sys.stderr)
            errors.append({"case": case["name"], "impl": impl, "error": msg[:2000]})
    del m, x, dy, w1, w2
    torch.cuda.empty_cache()
    return out


def cpp_layer_rows(case, args, errors):
    """The C++ GroupedMLP's rows (impl gmoe) from gmoe-bench --mode mlp on this case."""
    if not args.gmoe_bench:
        return []
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [args.gmoe_bench, "--suite", args.suite, "--mode", "mlp", "--case", case["name"], "--iters",
           str(args.iters), "--warm-ms", str(args.warm_ms), "--no-baselines", "--json", path]
    try:
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            rows = json.load(f)["rows"]
    except Exception as e:
        errors.append({"case": case["name"], "impl": "gmoe", "error": f"{' '.join(cmd)}: {e}"[:2000]})
        return []
    finally:
        os.unlink(path)
    return [r for r in rows if r["impl"] == "gmoe" and r["case"] == case["name"]]


def op_overhead_rows(device="cuda", calls=2000, repeats=5):
    """Host time per call of tiny gmoe ops and modules and of torch doing the same (see the module's
    docstring), on `device`."""
    import gmoe

    # CUDA: the smallest shapes torch._grouped_mm takes in bf16. CPU: smaller still and float32, so
    # that the CPU kernels' own work stays small next to the host path.
    E, rows, width, dt = (8, 64, 64, torch.bfloat16) if device == "cuda" else (2, 4, 8, torch.float32)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    dy = torch.randn(rows, width, device=device, dtype=dt)
    counts = torch.full((E,), rows // E, device=device, dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(rows, width, device=device, dtype=dt)
    w = torch.randn(E, width, width, device=device, dtype=dt) * width ** -0.5
    wt = w.transpose(-2, -1)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    wgt = wg.transpose(-2, -1)
    mlp = gmoe.GroupedMLP(E, width, width, activation="swiglu", bias=False, device=device, dtype=dt)
    w1 = mlp.fc1.weight.detach().clone().requires_grad_()
    w2 = mlp.fc2.weight.detach().clone().requires_grad_()
    torch_mlp = tb.MLP_FUNCTIONS["swiglu"]
    ops = torch.ops.gmoe
    # Megatron's layers: float32 main_grad on every parameter, marked by its DDP
    # (grad_added_to_main_grad); torch adds its gradients into main_grads of its own.
    mlp_mg = gmoe.GroupedMLP(E, width, width, activation="swiglu", bias=False, device=device, dtype=dt)
    mlp_dw = gmoe.GroupedMLP(E, width, width, activation="swiglu", bias=False, delay_wgrad_compute=True,
                             device=device, dtype=dt)
    for p in (*mlp_mg.parameters(), *mlp_dw.parameters()):
        p.main_grad = torch.zeros(p.shape, device=device, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    torch_main_grads = [torch.zeros(t.shape, device=device, dtype=torch.float32) for t in (w1, w2)]

    def megatron_step(m, delayed):
        y = m(xg, counts)
        dx, = torch.autograd.grad(y, [xg], dy)
        if delayed:
            m.backward_dw()
        return dx

    def torch_main_grad_step():
        dx, g1, g2 = torch.autograd.grad(torch_mlp(xg, w1, w2, offs), [xg, w1, w2], dy)
        torch_main_grads[0].add_(g1)
        torch_main_grads[1].add_(g2)
        return dx
    cases = [
        ("op_overhead", lambda: ops.grouped_bias_grad(dy, counts, None), lambda: dy.sum(0)),
        ("op_overhead/grouped_gemm", lambda: ops.grouped_gemm_fprop(x, [w], counts, [], None),
         lambda: torch._grouped_mm(x, wt, offs=offs)),
        ("op_overhead/grouped_gemm_ag", lambda: ops.grouped_gemm_fprop(xg, [wg], counts, [], None),
         lambda: torch._grouped_mm(xg, wgt, offs=offs)),
        ("op_overhead/mlp_forward", lambda: mlp(xg, counts), lambda: torch_mlp(xg, w1, w2, offs)),
        ("op_overhead/mlp_fwd_bwd",
         lambda: torch.autograd.grad(mlp(xg, counts), [xg, mlp.fc1.weight, mlp.fc2.weight], dy),
         lambda: torch.autograd.grad(torch_mlp(xg, w1, w2, offs), [xg, w1, w2], dy)),
        ("op_overhead/mlp_fwd_bwd_main_grad", lambda: megatron_step(mlp_mg, False), torch_main_grad_step),
        ("op_overhead/mlp_fwd_bwd_delayed", lambda: megatron_step(mlp_dw, True), torch_main_grad_step),
    ]

    def loop_us(fn):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        sync()
        return (t1 - t0) / calls * 1e6

    out = []
    for case, ours, theirs in cases:
        best = {"gmoe_op_overhead": float("inf"), "torch_op_overhead": float("inf")}
        for fn in (ours, theirs):
            for _ in range(50):
                fn()
        sync()
        for _ in range(repeats):
            for impl, fn in (("gmoe_op_overhead", ours), ("torch_op_overhead", theirs)):
                best[impl] = min(best[impl], loop_us(fn))
        out += [{"case": case, "pass": "call", "impl": impl, "dtype": "bf16" if dt == torch.bfloat16 else "f32",
                 "us_per_call": us, "correct": None}
                for impl, us in best.items()]
    return out


def summary(rows):
    by = {(r["case"], r["pass"], r["impl"]): r.get("ms") for r in rows}
    lines = []
    if any(r["impl"] == "gmoe_torch" for r in rows):
        lines = ["| case | pass | gmoe_torch ms | gmoe (C++) ms | package / C++ | torch ms | torch_compile ms | "
                 "x torch | x compiled |", "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    ratio = lambda a, b: "-" if a is None or b is None else f"{b / a:.3f}"  # noqa: E731
    for case, pass_name in sorted({(r["case"], r["pass"]) for r in rows if r["impl"] == "gmoe_torch"}):
        p, c = by.get((case, pass_name, "gmoe_torch")), by.get((case, pass_name, "gmoe"))
        t, tc = by.get((case, pass_name, "torch")), by.get((case, pass_name, "torch_compile"))
        pc = "-" if p is None or c is None else f"{p / c:.3f}"
        lines.append(f"| {case} | {pass_name} | {fmt(p)} | {fmt(c)} | {pc} | {fmt(t)} | {fmt(tc)} | "
                     f"{ratio(p, t)} | {ratio(p, tc)} |")
    us = {(r["case"], r["impl"]): r["us_per_call"] for r in rows if "us_per_call" in r}
    if us:
        lines += ["", "| overhead case | gmoe µs/call | torch µs/call | gmoe/torch |", "|---|---|---|---|"]
        for case in dict.fromkeys(c for c, _ in us):
            g, t = us.get((case, "gmoe_op_overhead")), us.get((case, "torch_op_overhead"))
            lines.append(f"| {case} | {fmt(g)} | {fmt(t)} | {ratio(t, g)} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="bench/suites/public.json")
    ap.add_argument("--json", required=True, help="output file")
    ap.add_argument("--case", default="", help="only cases whose name contains this")
    ap.add_argument("--gmoe-bench", default="", help="gmoe-bench binary: time the C++ layer in the same session")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--warm-ms", type=float, default=1000.0)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--overhead", action="store_true",
                    help="only the per-call host overhead rows (on the CPU when there is no GPU)")
    ap.add_argument("--overhead-calls", type=int, default=2000)
    ap.add_argument("--overhead-repeats", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.overhead:
        sys.exit("torch_module_bench.py: needs a CUDA GPU (--overhead runs on the CPU too)")
    with open(args.suite) as f:
        suite = json.load(f)
    cases = [c for c in suite["cases"] if c["kind"] == "mlp" and (not args.case or args.case in c["name"])
             and not args.overhead]
    rows, errors = [], []
    for case in cases:
        print(f"== {case['name']}", flush=True)
        rows += module_rows(case, args, errors)
        rows += cpp_layer_rows(case, args, errors)
    rows += op_overhead_rows(device, args.overhead_calls, args.overhead_repeats)
    for r in rows:  # bench/report.py tables them apart from the mlp mode's and torch_baseline.py's rows
        r["kind"] = "module"
    import gmoe  # noqa: F401
    result = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "suite": os.path.basename(args.suite).split(".")[0],
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cuda": torch.version.cuda,
              "rows": rows, "errors": errors}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(summary(rows))
    if errors:
        print(f"{len(errors)} errors (see {args.json})", file=sys.stderr)
    return 1 if any(r.get("correct") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

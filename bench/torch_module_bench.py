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

It also measures the op layer's per-call host overhead: a tiny gmoe op (grouped_bias_grad of
[64, 64], 8 experts) called back to back, against a torch op of the same size (torch.sum over
dim 0), in µs per call (impl "gmoe_op_overhead" / "torch_op_overhead", field "us_per_call").

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


def op_overhead_rows(calls=2000):
    """Host time per call of a tiny gmoe op and of a torch op of the same size."""
    import gmoe  # noqa: F401

    dy = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    counts = torch.full((8,), 8, device="cuda", dtype=torch.int32)

    def per_call(fn):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / calls * 1e6

    ops = torch.ops.gmoe
    return [
        {"case": "op_overhead", "pass": "call", "impl": "gmoe_op_overhead", "dtype": "bf16",
         "us_per_call": per_call(lambda: ops.grouped_bias_grad(dy, counts, None)), "correct": None},
        {"case": "op_overhead", "pass": "call", "impl": "torch_op_overhead", "dtype": "bf16",
         "us_per_call": per_call(lambda: dy.sum(0)), "correct": None},
    ]


def summary(rows):
    by = {(r["case"], r["pass"], r["impl"]): r.get("ms") for r in rows}
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
    for r in rows:
        if "us_per_call" in r:
            lines.append(f"\n{r['impl']}: {r['us_per_call']:.1f} µs per call")
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
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_module_bench.py: needs a CUDA GPU")
    with open(args.suite) as f:
        suite = json.load(f)
    cases = [c for c in suite["cases"] if c["kind"] == "mlp" and (not args.case or args.case in c["name"])]
    rows, errors = [], []
    for case in cases:
        print(f"== {case['name']}", flush=True)
        rows += module_rows(case, args, errors)
        rows += cpp_layer_rows(case, args, errors)
    rows += op_overhead_rows()
    for r in rows:  # bench/report.py tables them apart from the mlp mode's and torch_baseline.py's rows
        r["kind"] = "module"
    import gmoe  # noqa: F401
    result = {"gpu": torch.cuda.get_device_name(), "suite": os.path.basename(args.suite).split(".")[0],
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

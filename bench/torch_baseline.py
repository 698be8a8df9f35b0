#!/usr/bin/env python3
"""bench/torch_baseline.py — PyTorch baselines on the cases of a gmoe suite, same counts.

gemm cases: torch._grouped_mm (bf16) for the three passes, on the same shapes and counts as
gmoe-bench:  fprop  Y = _grouped_mm(X, Wᵀ, offs)        [rows, N]
             dgrad  dX = _grouped_mm(dY, W, offs)        [rows, K]
             wgrad  dW = _grouped_mm(dYᵀ, X, offs)       [E, N, K]
Timed with CUDA events: warm-up, then the median of --iters runs. Writes rows in the
BENCHMARKS.md results format (impl "torch", correct null).

Run on the GPU machine in the same session as gmoe-bench (scripts/gpu_check.sh does).
"""
import argparse
import json
import statistics
import sys

import torch


def time_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def gemm_rows(case, args):
    E, rows, K, N = case["E"], case["rows"], case["K"], case["N"]
    dev = "cuda"
    dt = torch.bfloat16
    x = torch.randn(rows, K, device=dev, dtype=dt)
    w = torch.randn(E, N, K, device=dev, dtype=dt)
    dy = torch.randn(rows, N, device=dev, dtype=dt)
    counts = torch.tensor(case["counts"], device=dev, dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    passes = {
        "fprop": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
        "wgrad": lambda: torch._grouped_mm(dy.t(), x, offs=offs),
    }
    flops = 2.0 * rows * N * K
    out = []
    for name, fn in passes.items():
        try:
            ms = time_ms(fn, args.warmup, args.iters)
            out.append({"case": case["name"], "pass": name, "impl": "torch", "dtype": "bf16",
                        "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "correct": None})
        except Exception as e:  # report and go on: one unsupported call must not hide the rest
            print(f"torch {case['name']} {name}: {type(e).__name__}: {e}", file=sys.stderr)
    del x, w, dy
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="bench/suites/public.json")
    ap.add_argument("--json", required=True)
    ap.add_argument("--case", default="", help="only cases whose name contains this")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    suite = json.load(open(args.suite))
    rows = []
    for case in suite["cases"]:
        if args.case and args.case not in case["name"]:
            continue
        if case["kind"] == "gemm":
            rows += gemm_rows(case, args)
            print(f"torch: {case['name']} done", flush=True)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    json.dump(result, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""bench/torch_baseline.py — PyTorch baselines on the cases of a gmoe suite, same counts.

gemm cases: torch._grouped_mm (bf16) for the three passes, on the same shapes and counts as
gmoe-bench:  fprop  Y = _grouped_mm(X, Wᵀ, offs)        [rows, N]
             dgrad  dX = _grouped_mm(dY, W, offs)        [rows, K]
             wgrad  dW = _grouped_mm(dYᵀ, X, offs)       [E, N, K]
           and torch._scaled_grouped_mm (e4m3, rowwise scales; per group and row for wgrad) for the
           same three passes, use_fast_accum off (torch_fp8_rowwise) and on (torch_fp8_rowwise_fast)
mlp cases: the expert MLP composed of torch ops, FC1 [E, 2·ffn, hidden] whose outputs are the
concatenated halves [gate | up], the case's gated activation, FC2 [E, hidden, ffn]:
             h = _grouped_mm(x, W1ᵀ, offs); gate, up = h.chunk(2); y = _grouped_mm(act(gate, up), W2ᵀ, offs)
           swiglu:          silu(gate)·up
           clamped_swiglu:  gate = min(gate, 7), up = clamp(up, -7, 7), gate·sigmoid(1.702·gate)·(up + 1)
  timed `forward` (with autograd recording, as in training) and `forward_backward` (forward, then
  torch.autograd.grad of a random dy for x, W1 and W2), eager (impl "torch") and the whole
  composition under torch.compile (impl "torch_compile", compiled and warmed up before timing; a
  compile failure is recorded under "errors" and the run goes on). FLOPs (BENCHMARKS.md): forward
  2·rows·hidden·2·ffn + 2·rows·ffn·hidden, forward_backward 3× that.
offs are the cumulative int32 row offsets of the counts.

Timed with CUDA events: warm-up, then the median of --iters runs. Writes rows in the
BENCHMARKS.md results format (correct null). --dry-run prints the cases and what would be timed
without importing torch.

Run on the GPU machine in the same session as gmoe-bench (scripts/gpu_check.sh does).
"""
import argparse
import json
import statistics
import sys
import time

torch = None  # imported in main (not needed by --dry-run)


def time_ms(fn, warmup, iters, warm_ms=0.0):
    for _ in range(warmup):
        fn()
    # warm_ms: more untimed runs until that much wall-clock time of back-to-back work has passed,
    # so the timed runs see the clocks of sustained load (gmoe-bench's --mlp-warm-ms does the same).
    t0 = time.time()
    while warm_ms > 0:
        torch.cuda.synchronize()
        if (time.time() - t0) * 1e3 >= warm_ms:
            break
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def row(case, pass_name, impl, ms, flops):
    return {"case": case["name"], "pass": pass_name, "impl": impl, "dtype": "bf16",
            "ms": ms, "tflops": flops / (ms * 1e-3) / 1e12, "correct": None}


def gemm_flops(case):
    return 2.0 * case["rows"] * case["N"] * case["K"]


def mlp_flops(case):
    """FLOPs of one forward: FC1 (2·ffn outputs) and FC2."""
    rows, hidden, ffn = case["rows"], case["hidden"], case["ffn"]
    return 2.0 * rows * hidden * 2 * ffn + 2.0 * rows * ffn * hidden


def gemm_rows(case, args, errors):
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
    flops = gemm_flops(case)
    out = []
    for name, fn in passes.items():
        try:
            ms = time_ms(fn, args.warmup, args.iters)
            out.append(row(case, name, "torch", ms, flops))
        except Exception as e:  # report and go on: one unsupported call must not hide the rest
            print(f"torch {case['name']} {name}: {type(e).__name__}: {e}", file=sys.stderr)
            errors.append({"case": case["name"], "pass": name, "impl": "torch", "error": f"{type(e).__name__}: {e}"})
    if not args.no_fp8:
        out += fp8_rowwise_rows(case, args, errors, x, w, dy, offs)
    del x, w, dy
    torch.cuda.empty_cache()
    return out


def rowwise_fp8(t, dim):
    """e4m3 copy of t with one f32 scale per slice along `dim` (amax over dim), and the
    dequantization multipliers (amax / 448), as torch's rowwise recipe uses them."""
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    q = (t.float() * (448.0 / amax)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, (amax / 448.0).squeeze(dim)


def fp8_rowwise_rows(case, args, errors, x, w, dy, offs):
    """torch._scaled_grouped_mm (e4m3, rowwise scales, bf16 out): the GEMM alone, operands
    quantized before timing, each in the layout the kernel wants (A row-major, B column-major).
    impl torch_fp8_rowwise: the default accumulation (use_fast_accum=False: partial sums promoted to
    fp32, as gmoe's FP8 GEMMs do; BENCHMARKS.md's anchor numbers); torch_fp8_rowwise_fast:
    use_fast_accum=True (the tensor cores' reduced-precision accumulation over the whole K)."""
    flops = gemm_flops(case)
    out = []
    try:
        xq, xs = rowwise_fp8(x, -1)                          # [rows, K], [rows]
        wq, ws = rowwise_fp8(w, -1)                          # [E, N, K], [E, N]
        dyq, dys = rowwise_fp8(dy, -1)                       # [rows, N], [rows]
        wtq, wts = rowwise_fp8(w.transpose(-2, -1).contiguous(), -1)  # [E, K, N], [E, K]
        # wgrad (the 2d x 2d case, groups along the reduction): dyᵀ [N, rows] row-major and x
        # [rows, K] column-major, each quantized with one scale per group and row of dyᵀ / column
        # of x (scales [E·N] and [E·K], group-major).
        bounds = [0] + offs.tolist()
        dyt = dy.t().contiguous()                              # [N, rows]
        xt = x.t().contiguous()                                # [K, rows]
        dytq, xtq = torch.empty_like(dyt, dtype=torch.float8_e4m3fn), torch.empty_like(xt, dtype=torch.float8_e4m3fn)
        dyts, xts = [], []
        for g in range(len(bounds) - 1):
            lo, hi = bounds[g], bounds[g + 1]
            for src, dst, scales in ((dyt, dytq, dyts), (xt, xtq, xts)):
                if hi > lo:
                    q, s = rowwise_fp8(src[:, lo:hi], -1)
                    dst[:, lo:hi] = q
                else:
                    s = torch.ones(src.shape[0], device=src.device)
                scales.append(s)
        dyts, xts = torch.cat(dyts), torch.cat(xts)

        def passes(fast):
            return {
                "fprop": lambda: torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), xs, ws, offs=offs,
                                                          out_dtype=torch.bfloat16, use_fast_accum=fast),
                "dgrad": lambda: torch._scaled_grouped_mm(dyq, wtq.transpose(-2, -1), dys, wts, offs=offs,
                                                          out_dtype=torch.bfloat16, use_fast_accum=fast),
                "wgrad": lambda: torch._scaled_grouped_mm(dytq, xtq.t(), dyts, xts, offs=offs,
                                                          out_dtype=torch.bfloat16, use_fast_accum=fast),
            }
    except Exception as e:
        errors.append({"case": case["name"], "impl": "torch_fp8_rowwise", "error": f"{type(e).__name__}: {e}"})
        return out
    # The 2d x 2d (wgrad) form reads each group's tokens as the K extent of a TMA box: every count
    # must be a multiple of 16 (fp8 bytes), or torch's kernel fails a device-side assert that
    # poisons the CUDA context for every later measurement of the process. Such cases are skipped.
    counts = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    wgrad_ok = all(c % 16 == 0 for c in counts)
    for impl, fast in (("torch_fp8_rowwise", False), ("torch_fp8_rowwise_fast", True)):
        for name, fn in passes(fast).items():
            if name == "wgrad" and not wgrad_ok:
                errors.append({"case": case["name"], "pass": name, "impl": impl,
                               "error": "skipped: torch._scaled_grouped_mm (2d x 2d) needs every count to be a "
                                        "multiple of 16"})
                continue
            try:
                ms = time_ms(fn, args.warmup, args.iters)
                r = row(case, name, impl, ms, flops)
                r["dtype"] = "fp8"
                out.append(r)
            except Exception as e:
                print(f"{impl} {case['name']} {name}: {type(e).__name__}: {e}", file=sys.stderr)
                errors.append({"case": case["name"], "pass": name, "impl": impl, "error": f"{type(e).__name__}: {e}"})
    return out


# ---------------------------------------------------------------------------------------------
# mlp cases

def swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


def clamped_swiglu(gate, up):
    gate = gate.clamp(max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


def expert_mlp(x, w1, w2, offs, act):
    """x [rows, hidden]; w1 [E, 2·ffn, hidden] (outputs [gate | up]); w2 [E, hidden, ffn]."""
    h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(act(gate, up), w2.transpose(-2, -1), offs=offs)


def mlp_swiglu(x, w1, w2, offs):
    return expert_mlp(x, w1, w2, offs, swiglu)


def mlp_clamped_swiglu(x, w1, w2, offs):
    return expert_mlp(x, w1, w2, offs, clamped_swiglu)


MLP_FUNCTIONS = {"swiglu": mlp_swiglu, "clamped_swiglu": mlp_clamped_swiglu}
_compiled = {}


def compiled_mlp(activation):
    # One compiled function per activation, shared by the cases (a new shape recompiles; the
    # counts are a tensor, so the splits of one shape share the compiled code).
    if activation not in _compiled:
        _compiled[activation] = torch.compile(MLP_FUNCTIONS[activation], dynamic=False)
    return _compiled[activation]


def mlp_rows(case, args, errors):
    E, rows, hidden, ffn, act = case["E"], case["rows"], case["hidden"], case["ffn"], case.get("activation", "swiglu")
    if act not in MLP_FUNCTIONS:
        errors.append({"case": case["name"], "impl": "torch", "error": f"unknown activation '{act}'"})
        print(f"torch {case['name']}: unknown activation '{act}', skipped", file=sys.stderr)
        return []
    dev = "cuda"
    dt = torch.bfloat16
    x = torch.randn(rows, hidden, device=dev, dtype=dt).requires_grad_()
    w1 = (torch.randn(E, 2 * ffn, hidden, device=dev, dtype=dt) * hidden ** -0.5).requires_grad_()
    w2 = (torch.randn(E, hidden, ffn, device=dev, dtype=dt) * ffn ** -0.5).requires_grad_()
    dy = torch.randn(rows, hidden, device=dev, dtype=dt)
    counts = torch.tensor(case["counts"], device=dev, dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    flops = mlp_flops(case)
    impls = [("torch", MLP_FUNCTIONS[act])]
    if not args.no_compile:
        impls.append(("torch_compile", compiled_mlp(act)))
    out = []
    for impl, fn in impls:
        def forward():
            return fn(x, w1, w2, offs)

        def forward_backward():
            y = fn(x, w1, w2, offs)
            torch.autograd.grad(y, (x, w1, w2), grad_outputs=dy)

        try:
            t0 = time.time()
            for _ in range(2):  # torch.compile: compiles forward and backward here, before timing
                forward_backward()
            torch.cuda.synchronize()
            if impl == "torch_compile":
                print(f"torch: {case['name']} compiled in {time.time() - t0:.1f} s", flush=True)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            print(f"{impl} {case['name']}: {msg}", file=sys.stderr)
            errors.append({"case": case["name"], "impl": impl, "error": msg[:2000]})
            continue
        for pass_name, run, pass_flops in (("forward", forward, flops), ("forward_backward", forward_backward, 3 * flops)):
            try:
                ms = time_ms(run, args.warmup, args.iters, args.mlp_warm_ms)
                out.append(row(case, pass_name, impl, ms, pass_flops))
            except Exception as e:
                msg = f"{type(e).__name__}: {e}"
                print(f"{impl} {case['name']} {pass_name}: {msg}", file=sys.stderr)
                errors.append({"case": case["name"], "pass": pass_name, "impl": impl, "error": msg[:2000]})
    del x, w1, w2, dy
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------

def selected_cases(suite, args):
    kinds = {"gemm", "mlp"} if args.kind == "all" else {args.kind}
    return [c for c in suite["cases"] if c["kind"] in kinds and (not args.case or args.case in c["name"])]


def describe(case, args):
    if case["kind"] == "gemm":
        shape = f"rows {case['rows']}, K {case['K']}, N {case['N']}"
        timed = "fprop, dgrad, wgrad (torch)"
        gflop = gemm_flops(case) / 1e9
    else:
        shape = (f"rows {case['rows']}, hidden {case['hidden']}, ffn {case['ffn']}, "
                 f"{case.get('activation', 'swiglu')}")
        impls = "torch" + ("" if args.no_compile else ", torch_compile")
        timed = f"forward, forward_backward ({impls})"
        gflop = mlp_flops(case) / 1e9
    return f"{case['name']:24s} {case['kind']:4s} E {case['E']:3d}, {shape}: {timed}; {gflop:.0f} GFLOP forward/pass"


def main():
    global torch
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="bench/suites/public.json")
    ap.add_argument("--json", help="output file (required unless --dry-run)")
    ap.add_argument("--case", default="", help="only cases whose name contains this")
    ap.add_argument("--kind", choices=["gemm", "mlp", "all"], default="all", help="which kind of case to run")
    ap.add_argument("--no-compile", action="store_true", help="mlp cases: skip the torch.compile baseline")
    ap.add_argument("--no-fp8", action="store_true", help="gemm cases: skip torch._scaled_grouped_mm")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mlp-warm-ms", type=float, default=1000.0,
                    help="mlp cases: ms of back-to-back untimed work before each timing (clocks of sustained load)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="print the cases and what would be timed, then exit")
    args = ap.parse_args()
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    if not args.dry_run and not args.json:
        ap.error("--json is required (unless --dry-run)")
    with open(args.suite) as f:
        suite = json.load(f)
    cases = selected_cases(suite, args)
    if args.dry_run:
        for case in cases:
            print(describe(case, args))
        print(f"{len(cases)} cases")
        return
    import torch as torch_module
    torch = torch_module
    rows, errors = [], []
    for case in cases:
        t0 = time.time()
        rows += gemm_rows(case, args, errors) if case["kind"] == "gemm" else mlp_rows(case, args, errors)
        print(f"torch: {case['name']} done ({time.time() - t0:.1f} s)", flush=True)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows, "errors": errors}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""bench/torch_baseline.py — PyTorch baselines on the cases of a gmoe suite, same counts.

gemm cases: torch._grouped_mm (bf16) for the three passes, on the same shapes and counts as
gmoe-bench:  fprop  Y = _grouped_mm(X, Wᵀ, offs)        [rows, N]
             dgrad  dX = _grouped_mm(dY, W, offs)        [rows, K]
             wgrad  dW = _grouped_mm(dYᵀ, X, offs)       [E, N, K]
           and torch._scaled_grouped_mm (e4m3, rowwise scales; per group and row for wgrad) for the
           same three passes, use_fast_accum off (torch_fp8_rowwise) and on (torch_fp8_rowwise_fast);
           and DeepSeek-V3's blockwise recipe through cuBLASLt (torch._scaled_mm, one call per expert
           with tokens, impl torch_fp8_blockwise: the host knows the counts, so this loop is a
           baseline, not a capturable op): fprop x 1x128 by W 128x128, dgrad dy 1x128 by Wᵀ
           128x128, wgrad dyᵀ 1x128 by xᵀ 1x128 (both scaled along the tokens; each expert's
           tokens zero-padded to a multiple of 16 for cuBLAS's alignment); each pass's row carries
           the relative Frobenius error of its first expert against the bf16 product in "note"
mlp cases: the expert MLP composed of torch ops, FC1 [E, 2·ffn, hidden] whose outputs are the
concatenated halves [gate | up], the case's gated activation, FC2 [E, hidden, ffn]:
             h = _grouped_mm(x, W1ᵀ, offs); gate, up = h.chunk(2); y = _grouped_mm(act(gate, up), W2ᵀ, offs)
           swiglu:          silu(gate)·up
           clamped_swiglu:  gate = min(gate, 7), up = clamp(up, -7, 7), gate·sigmoid(1.702·gate)·(up + 1)
  timed `forward` (with autograd recording, as in training) and `forward_backward` (forward, then
  torch.autograd.grad of a random dy for x, W1 and W2), eager (impl "torch") and the whole
  composition under torch.compile (impl "torch_compile", compiled and warmed up before timing; a
  compile failure is recorded under "errors" and the run goes on). FLOPs (docs/benchmarks.md): forward
  2·rows·hidden·2·ffn + 2·rows·ffn·hidden, forward_backward 3× that.
layer (the gemm cases, as gmoe-bench --mode layer): the GroupedLinear forward and forward+backward
           composed of torch ops, x [rows, K], W [E, N, K], a bf16 bias [E, N] and an f32 main_grad
           [E, N, K] that the weight gradient is added into (gmoe's layer accumulates into it too):
             forward   y = mm(x, Wᵀ) + bias[expert of row]
             backward  dx = mm(dy, W); dW = mm(dyᵀ, x) (groups along the reduction); main_grad += dW;
                       dbias = Σ of each expert's rows of dy
           bf16 (impl torch_linear: _grouped_mm), and FP8 rowwise (torch_linear_fp8_rowwise, eager;
           torch_linear_fp8_rowwise_compile, forward and backward under torch.compile, with
           --kind layer only: each shape compiles anew): the
           quantization is timed with the GEMMs, the weights' two copies cached (quantized before
           timing, as gmoe's +cached_weights): x and dy with one scale per row, dyᵀ and xᵀ for
           the weight gradient one per expert and row of dyᵀ / column of x (amax over the expert's
           tokens), then torch._scaled_grouped_mm. The FP8 rows carry the relative Frobenius error
           of y, dx and dW against the bf16 layer's. The weight gradient needs every count a
           multiple of 16 (see fp8_rowwise_rows): on other counts only the forward is timed.
offs are the cumulative int32 row offsets of the counts.

Timed with CUDA events: warm-up, then (mlp and layer cases) --warm-ms of untimed back-to-back work,
then the median of --iters runs. Writes rows in the
docs/benchmarks.md results format (correct null). --dry-run prints the cases and what would be timed
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
    # so the timed runs see the clocks of sustained load (gmoe-bench's --warm-ms does the same).
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
        out += fp8_blockwise_rows(case, args, errors, x, w, dy)
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
    fp32, as gmoe's FP8 GEMMs do; docs/benchmarks.md's anchor numbers); torch_fp8_rowwise_fast:
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


def blockwise_fp8(t, block_rows):
    """e4m3 copy of a 2-d t in blocks of block_rows x 128 (DeepSeek-V3's 1x128 or 128x128; partial
    blocks at the edges), and the dequantization multipliers [ceil(R/block_rows), ceil(C/128)]."""
    R, C = t.shape
    Rp, Cp = -(-R // block_rows) * block_rows, -(-C // 128) * 128
    padded = torch.zeros(Rp, Cp, device=t.device, dtype=torch.float32)
    padded[:R, :C] = t
    blocks = padded.view(Rp // block_rows, block_rows, Cp // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    q = (blocks * (448.0 / amax)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(Rp, Cp)[:R, :C].contiguous()
    return q, (amax / 448.0).view(Rp // block_rows, Cp // 128)


def outer_major(s):
    """A [R, C] scale matrix with strides (1, R), as cuBLAS's 1x128 scales of A are laid out."""
    out = torch.empty_strided(s.shape, (1, s.shape[0]), device=s.device, dtype=s.dtype)
    out.copy_(s)
    return out


def block_scale_b(s, aligned=False):
    """The 128x128 scales s [Nb, Kb] of a weight B [N, K] as torch._scaled_mm takes them for mat2 =
    Bᵀ: [Kb, Nb] with strides (1, Kb), or (1, Kb rounded up to 4) where a torch build wants the
    rows 16-byte aligned (aligned=True)."""
    if aligned and s.size(1) % 4:
        padded = torch.zeros(s.size(0), -(-s.size(1) // 4) * 4, device=s.device, dtype=s.dtype)
        padded[:, :s.size(1)] = s
        s = padded[:, :s.size(1)]
    return s.t()


def fp8_blockwise_rows(case, args, errors, x, w, dy):
    """torch._scaled_mm with DeepSeek-V3's blockwise scales (cuBLASLt on sm_90), one call per
    expert with tokens: the grouped GEMM a user of torch builds from what torch offers for this
    recipe (torch._scaled_grouped_mm takes blockwise scales only in builds newer than this one's
    CUDA). Operands quantized before timing, each expert's in the layout the call wants."""
    E, K, N = case["E"], case["K"], case["N"]
    flops = gemm_flops(case)
    bounds = [0]
    for c in case["counts"]:
        bounds.append(bounds[-1] + c)
    experts = [e for e in range(E) if case["counts"][e] > 0]
    out = []
    try:
        fprop, dgrad, wgrad = [], [], []
        for e in experts:
            # Each expert's tokens, zero-padded to a multiple of 16 (cuBLAS's alignment; the padding
            # adds at most 15 rows of FLOPs, not counted).
            lo, hi = bounds[e], bounds[e + 1]
            pad = -(-(hi - lo) // 16) * 16
            xe = torch.zeros(pad, K, device=x.device, dtype=x.dtype)
            dye = torch.zeros(pad, N, device=x.device, dtype=x.dtype)
            xe[:hi - lo] = x[lo:hi]
            dye[:hi - lo] = dy[lo:hi]
            xq, xs = blockwise_fp8(xe, 1)                          # [pad, K], [pad, Kb]
            dyq, dys = blockwise_fp8(dye, 1)                       # [pad, N], [pad, Nb]
            wq, ws = blockwise_fp8(w[e], 128)                      # [N, K], [Nb, Kb]
            wtq, wts = blockwise_fp8(w[e].t(), 128)                # [K, N], [Kb, Nb]
            fprop.append((xq, wq.t(), outer_major(xs), ws, (xe, w[e].t())))
            dgrad.append((dyq, wtq.t(), outer_major(dys), wts, (dye, w[e])))
            dytq, dyts = blockwise_fp8(dye.t(), 1)                 # [N, pad], [N, pad/128]
            xtq, xts = blockwise_fp8(xe.t(), 1)                    # [K, pad], [K, pad/128]
            wgrad.append((dytq, xtq.t(), outer_major(dyts), outer_major(xts).t(), (dye.t(), xe)))
    except Exception as e:
        errors.append({"case": case["name"], "impl": "torch_fp8_blockwise", "error": f"{type(e).__name__}: {e}"})
        return out

    def call(a, b, sa, sb):
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    for name, calls in (("fprop", fprop), ("dgrad", dgrad), ("wgrad", wgrad)):
        try:
            if not calls:
                continue
            # 128x128 scales of B (fprop, dgrad): torch builds differ on whether their rows must be
            # 16-byte aligned; the first call tells.
            prepared = []
            for a, b, sa, sb, ref in calls:
                if name == "wgrad":
                    call(a, b, sa, sb)
                else:
                    try:
                        sb_ = block_scale_b(sb)
                        call(a, b, sa, sb_)
                    except RuntimeError:
                        sb_ = block_scale_b(sb, aligned=True)
                        call(a, b, sa, sb_)
                    sb = sb_
                prepared.append((a, b, sa, sb, ref))
            a, b, sa, sb, ref = prepared[0]
            note = f"first expert: relative Frobenius error {relative_error(call(a, b, sa, sb), ref[0].float() @ ref[1].float()):.4f}"

            def run_all():
                for a, b, sa, sb, _ in prepared:
                    call(a, b, sa, sb)
            r = row(case, name, "torch_fp8_blockwise", time_ms(run_all, args.warmup, args.iters), flops)
            r["dtype"] = "fp8"
            r["note"] = note
            out.append(r)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            print(f"torch_fp8_blockwise {case['name']} {name}: {msg[:300]}", file=sys.stderr)
            errors.append({"case": case["name"], "pass": name, "impl": "torch_fp8_blockwise", "error": msg[:2000]})
    return out


# ---------------------------------------------------------------------------------------------
# layer (the gemm cases): GroupedLinear composed of torch ops

def expert_of_rows(counts, rows):
    """Expert index of every row [rows] (int64), from the device counts without a host sync."""
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts.long(),
                                   output_size=rows)


def expert_sums(t, counts):
    """[E, cols] f32: Σ over each expert's rows of t (the bias gradient)."""
    return torch.segment_reduce(t.float(), "sum", lengths=counts.long(), axis=0, unsafe=True, initial=0.0)


def grouped_cols_fp8(t, counts, idx):
    """tᵀ [cols, rows] e4m3, row-major, with one scale per expert and column of t (amax over the
    expert's rows), and the dequantization multipliers [E·cols] (expert-major): the operand form
    of torch._scaled_grouped_mm's 2d x 2d (weight gradient) call."""
    amax = torch.segment_reduce(t.abs().float(), "max", lengths=counts.long(), axis=0, unsafe=True,
                                initial=0.0).clamp(min=1e-12)                     # [E, cols]
    q = (t.float() * (448.0 / amax).index_select(0, idx)).clamp(-448.0, 448.0)
    return q.t().contiguous().to(torch.float8_e4m3fn), (amax / 448.0).reshape(-1)


def linear_forward_bf16(x, w, bias, offs, idx):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs) + bias.index_select(0, idx)


def linear_backward_bf16(x, w, dy, main_grad, counts, offs):
    dx = torch._grouped_mm(dy, w, offs=offs)
    main_grad.add_(torch._grouped_mm(dy.t(), x, offs=offs))
    return dx, expert_sums(dy, counts)


def linear_forward_fp8(x, wq, ws, bias, offs, idx):
    xq, xs = rowwise_fp8(x, -1)
    return torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), xs, ws, offs=offs,
                                    out_dtype=torch.bfloat16) + bias.index_select(0, idx)


def linear_backward_fp8(x, wtq, wts, dy, main_grad, counts, offs, idx):
    dyq, dys = rowwise_fp8(dy, -1)
    dx = torch._scaled_grouped_mm(dyq, wtq.transpose(-2, -1), dys, wts, offs=offs, out_dtype=torch.bfloat16)
    dytq, dyts = grouped_cols_fp8(dy, counts, idx)   # [N, rows], [E·N]
    xtq, xts = grouped_cols_fp8(x, counts, idx)      # [K, rows], [E·K]
    main_grad.add_(torch._scaled_grouped_mm(dytq, xtq.t(), dyts, xts, offs=offs, out_dtype=torch.bfloat16))
    return dx, expert_sums(dy, counts)


def relative_error(got, ref):
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def layer_rows(case, args, errors):
    E, rows, K, N = case["E"], case["rows"], case["K"], case["N"]
    dev = "cuda"
    dt = torch.bfloat16
    x = torch.randn(rows, K, device=dev, dtype=dt)
    w = torch.randn(E, N, K, device=dev, dtype=dt) * K ** -0.5
    bias = torch.randn(E, N, device=dev, dtype=dt)
    dy = torch.randn(rows, N, device=dev, dtype=dt)
    main_grad = torch.zeros(E, N, K, device=dev, dtype=torch.float32)
    counts = torch.tensor(case["counts"], device=dev, dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    idx = expert_of_rows(counts, rows)
    flops = gemm_flops(case)
    wgrad_ok = all(c % 16 == 0 for c in case["counts"])
    out = []

    def timed(impl, forward, backward, check=None):
        try:
            note = check() if check else None
            main_grad.zero_()
            for name, fn, f in (("forward", forward, flops),
                                ("forward_backward", lambda: (forward(), backward()), 3 * flops)):
                if name == "forward_backward" and backward is None:
                    errors.append({"case": case["name"], "pass": name, "impl": impl,
                                   "error": "skipped: torch._scaled_grouped_mm (2d x 2d) needs every count to "
                                            "be a multiple of 16"})
                    continue
                r = row(case, name, impl, time_ms(fn, args.warmup, args.iters, args.warm_ms), f)
                if impl != "torch_linear":
                    r["dtype"] = "fp8"
                if note:
                    r["note"] = note
                out.append(r)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            print(f"{impl} {case['name']}: {msg}", file=sys.stderr)
            errors.append({"case": case["name"], "impl": impl, "error": msg[:2000]})

    timed("torch_linear", lambda: linear_forward_bf16(x, w, bias, offs, idx),
          lambda: linear_backward_bf16(x, w, dy, main_grad, counts, offs))
    if not args.no_fp8:
        wq, ws = rowwise_fp8(w, -1)                                      # [E, N, K], [E, N]
        wtq, wts = rowwise_fp8(w.transpose(-2, -1).contiguous(), -1)      # [E, K, N], [E, K]
        fwd, bwd = linear_forward_fp8, linear_backward_fp8
        impls = [("torch_linear_fp8_rowwise", fwd, bwd)]
        # Compiled only when asked for the layer alone: each shape compiles anew (tens of seconds).
        if not args.no_compile and args.kind == "layer":
            impls.append(("torch_linear_fp8_rowwise_compile", torch.compile(fwd, dynamic=False),
                          torch.compile(bwd, dynamic=False)))
        for impl, f, b in impls:
            def check(f=f, b=b):
                y_ref = linear_forward_bf16(x, w, bias, offs, idx)
                err = f"y: relative Frobenius error {relative_error(f(x, wq, ws, bias, offs, idx), y_ref):.4f}"
                if wgrad_ok:
                    main_grad.zero_()
                    dx_ref, db_ref = linear_backward_bf16(x, w, dy, main_grad, counts, offs)
                    dw_ref = main_grad.clone()
                    main_grad.zero_()
                    dx, db = b(x, wtq, wts, dy, main_grad, counts, offs, idx)
                    err += (f"; dx {relative_error(dx, dx_ref):.4f}; dW {relative_error(main_grad, dw_ref):.4f}"
                            f"; dbias {relative_error(db, db_ref):.2e}")
                return err
            timed(impl, lambda f=f: f(x, wq, ws, bias, offs, idx),
                  (lambda b=b: b(x, wtq, wts, dy, main_grad, counts, offs, idx)) if wgrad_ok else None, check)
    del x, w, dy, main_grad
    torch.cuda.empty_cache()
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
                ms = time_ms(run, args.warmup, args.iters, args.warm_ms)
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
    kinds = {"gemm", "mlp"} if args.kind == "all" else {"gemm" if args.kind == "layer" else args.kind}
    return [c for c in suite["cases"] if c["kind"] in kinds and (not args.case or args.case in c["name"])]


def describe(case, args):
    if case["kind"] == "gemm":
        shape = f"rows {case['rows']}, K {case['K']}, N {case['N']}"
        timed = "fprop, dgrad, wgrad (torch)"
        if args.kind in ("layer", "all"):
            timed = ("" if args.kind == "layer" else timed + "; ") + \
                "layer forward, forward_backward (torch_linear" + ("" if args.no_fp8 else ", fp8 rowwise") + ")"
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
    ap.add_argument("--kind", choices=["gemm", "mlp", "layer", "all"], default="all",
                    help="which cases to run: gemm, mlp, layer (the gemm cases as GroupedLinear), all three")
    ap.add_argument("--no-compile", action="store_true", help="mlp and layer: skip the torch.compile baselines")
    ap.add_argument("--no-fp8", action="store_true", help="gemm and layer: skip torch._scaled_grouped_mm")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--warm-ms", "--mlp-warm-ms", dest="warm_ms", type=float, default=1000.0,
                    help="mlp and layer cases: ms of back-to-back untimed work before each timing (clocks of "
                         "sustained load, as gmoe-bench's --warm-ms)")
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
        if case["kind"] == "mlp":
            rows += mlp_rows(case, args, errors)
        else:
            if args.kind != "layer":
                rows += gemm_rows(case, args, errors)
            if args.kind in ("layer", "all"):
                rows += layer_rows(case, args, errors)
        print(f"torch: {case['name']} done ({time.time() - t0:.1f} s)", flush=True)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows, "errors": errors}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

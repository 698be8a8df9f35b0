"""The gmoe ops on CPU tensors (gmoe's CPU reference backend) against plain torch: values,
gradients, gradcheck, torch.library.opcheck, and bad input."""
import pytest
import torch

import gmoe
import reference as ref

E, K, N, CAP = 4, 24, 16, 40
TOTAL = 33  # rows past the total (CAP - TOTAL) must come out as zeros


def routing(name, E=E, total=TOTAL, dtype=torch.int32):
    return ref.counts_tensor(ref.ROUTINGS[name](E, total), dtype=dtype)


def poisoned(*shape, dtype=torch.float32):
    """Random inputs; the rows past the total are NaN so that reading them would show."""
    t = torch.randn(*shape, dtype=dtype)
    return t


@pytest.mark.parametrize("route", list(ref.ROUTINGS))
@pytest.mark.parametrize("layout", ["stacked", "list"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("counts_dtype", [torch.int32, torch.int64])
def test_grouped_gemm_values_and_grads(route, layout, with_bias, counts_dtype):
    counts = routing(route, dtype=counts_dtype)
    x = torch.randn(CAP, K, requires_grad=True)
    w = torch.randn(E, N, K, requires_grad=True)
    b = torch.randn(E, N, requires_grad=True) if with_bias else None
    w_arg = w if layout == "stacked" else list(w.unbind(0))
    b_arg = None if b is None else (b if layout == "stacked" else list(b.unbind(0)))
    y = gmoe.grouped_gemm(x, w_arg, counts, b_arg)
    y_ref = ref.grouped_linear(x, w, counts.tolist(), b)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert torch.all(y[int(counts.sum()):] == 0)
    dy = torch.randn_like(y)
    inputs = [x, w] + ([b] if b is not None else [])
    got = torch.autograd.grad(y, inputs, dy)
    want = torch.autograd.grad(y_ref, inputs, dy)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", ["uniform", "skewed_empty"])
def test_grouped_gemm_bf16_tolerance(route):
    counts = routing(route)
    x = torch.randn(CAP, K, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    y = gmoe.grouped_gemm(x, w, counts)
    y64 = ref.grouped_linear(x.double(), w.double(), counts.tolist())
    y_bf16 = ref.grouped_linear(x, w, counts.tolist())
    ok, errs = ref.tolerance_ok(y, y64, y_bf16, atol=1e-3)
    assert ok, errs


def test_grouped_gemm_wgrad_into_main_grad_with_mask():
    counts = routing("skewed_empty")
    dy, x = torch.randn(CAP, N), torch.randn(CAP, K)
    main_grad = torch.randn(E, N, K)
    before = main_grad.clone()
    mask = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    gmoe.grouped_gemm_wgrad(dy, x, counts, out=main_grad, accumulate=True, expert_mask=mask)
    o = ref.offsets(counts.tolist())
    for e in range(E):
        dw = dy[o[e]:o[e + 1]].T @ x[o[e]:o[e + 1]]
        want = before[e] + dw if mask[e] else before[e]
        torch.testing.assert_close(main_grad[e], want, rtol=1e-5, atol=1e-5)
    # overwrite, per-expert list
    outs = [torch.full((N, K), 7.0) for _ in range(E)]
    gmoe.grouped_gemm_wgrad(dy, x, counts, out=outs)
    fresh = gmoe.grouped_gemm_wgrad(dy, x, counts)
    for e in range(E):
        torch.testing.assert_close(outs[e], fresh[e])
        if counts[e] == 0:
            assert torch.all(fresh[e] == 0)


def test_grouped_gemm_dgrad():
    counts = routing("uniform")
    dy, w = torch.randn(CAP, N), torch.randn(E, N, K)
    dx = gmoe.grouped_gemm_dgrad(dy, w, counts)
    o = ref.offsets(counts.tolist())
    want = torch.zeros(CAP, K)
    for e in range(E):
        want[o[e]:o[e + 1]] = dy[o[e]:o[e + 1]] @ w[e]
    torch.testing.assert_close(dx, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", list(ref.ROUTINGS))
def test_grouped_bias_add_and_grad(route):
    counts = routing(route)
    y = torch.randn(CAP, N, requires_grad=True)
    b = torch.randn(E, N, requires_grad=True)
    out = gmoe.grouped_bias_add(y, b, counts)
    o = ref.offsets(counts.tolist())
    want = y.detach().clone()
    for e in range(E):
        want[o[e]:o[e + 1]] += b.detach()[e]
    torch.testing.assert_close(out, want)
    dy = torch.randn_like(out)
    gy, gb = torch.autograd.grad(out, (y, b), dy)
    torch.testing.assert_close(gy, dy)
    want_db = torch.stack([dy[o[e]:o[e + 1]].sum(0) for e in range(E)])
    torch.testing.assert_close(gb, want_db, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gmoe.grouped_bias_grad(dy, counts), want_db, rtol=1e-5, atol=1e-5)


ACTS = [("swiglu", {}), ("geglu", {}), ("geglu", {"gelu_tanh": True}), ("clamped_swiglu", {}),
        ("clamped_swiglu", {"alpha": 1.0, "limit": 0.5}), ("squared_relu", {})]


@pytest.mark.parametrize("kind,kw", ACTS, ids=lambda v: str(v))
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("glu_block", [0, 4])
def test_grouped_activation(kind, kw, with_probs, glu_block):
    if kind == "squared_relu" and glu_block:
        pytest.skip("squared_relu is not gated")
    counts = routing("skewed_empty")
    Fh = 16
    h = (3 * torch.randn(CAP, Fh if kind == "squared_relu" else 2 * Fh)).requires_grad_()
    probs = torch.rand(CAP, requires_grad=True) if with_probs else None
    z = gmoe.grouped_activation(h, counts, kind, probs, glu_layout=glu_block, **kw)
    z_ref = ref.grouped_activation(h, counts.tolist(), kind, probs, glu_block=glu_block, **kw)
    torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-5)
    dz = torch.randn_like(z)
    inputs = [h] + ([probs] if with_probs else [])
    for g, r in zip(torch.autograd.grad(z, inputs, dz), torch.autograd.grad(z_ref, inputs, dz)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


F32_GRADCHECK = pytest.mark.filterwarnings("ignore:Input #.*double precision")


@F32_GRADCHECK
@pytest.mark.parametrize("kind", gmoe.ACTIVATIONS)
def test_gradcheck_activation(kind):
    counts = routing("skewed_empty", E=3, total=9)
    cols = 8 if kind == "squared_relu" else 16
    h = torch.randn(11, cols, requires_grad=True)
    probs = torch.rand(11, requires_grad=True)
    fn = lambda h, p: gmoe.grouped_activation(h, counts, kind, p)  # noqa: E731
    # float32 only (gmoe has no f64): finite differences with a larger step and tolerance.
    assert torch.autograd.gradcheck(fn, (h, probs), eps=1e-2, atol=2e-2, rtol=2e-2, nondet_tol=0.0)


@F32_GRADCHECK
def test_gradcheck_grouped_gemm():
    counts = routing("skewed_empty", E=3, total=9)
    x = torch.randn(11, 6, requires_grad=True)
    w = torch.randn(3, 5, 6, requires_grad=True)
    b = torch.randn(3, 5, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: gmoe.grouped_gemm(x, w, counts, b), (x, w, b),
                                    eps=1e-2, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["clamped_swiglu", "squared_relu"])
@pytest.mark.parametrize("per_expert", [False, True])
def test_fprop_of_activation_is_the_two_ops_bitwise(kind, per_expert):
    """grouped_gemm_fprop_of_activation (z = act(h)·probs made inside, again in backward) gives
    bitwise the values and gradients of the activation op followed by grouped_gemm_fprop."""
    counts = routing("skewed_empty")
    cols = 16 if kind == "squared_relu" else 32
    h = torch.randn(CAP, cols, requires_grad=True)
    probs = torch.rand(CAP, requires_grad=True)
    w = torch.randn(E, N, 16, requires_grad=True)
    b = torch.randn(E, N, requires_grad=True)
    ws = list(w.unbind(0)) if per_expert else [w]
    args = (kind, probs, 1.5, 3.0, False, 4 if kind != "squared_relu" else 0)
    y = torch.ops.gmoe.grouped_gemm_fprop_of_activation(h, ws, counts, [b], *args)
    z = torch.ops.gmoe.grouped_activation_forward(h, counts, *args)
    y_ref = torch.ops.gmoe.grouped_gemm_fprop(z, ws, counts, [b], None)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    inputs = [h, probs, w, b]
    for g, r in zip(torch.autograd.grad(y, inputs, dy), torch.autograd.grad(y_ref, inputs, dy)):
        assert torch.equal(g, r)


@pytest.mark.parametrize("block", [1, 4])
def test_fc1_glu_convert_roundtrip(block):
    w = torch.randn(E, 2 * 8, K)
    inter = gmoe.fc1_glu_convert(w, "concatenated", f"interleaved:{block}")
    g, u = ref.gate_up(inter[0].T, block)  # the 2F rows of a weight are the columns of h
    assert torch.equal(g, w[0][:8].T) and torch.equal(u, w[0][8:].T)
    back = gmoe.fc1_glu_convert(inter, block, 0)
    assert torch.equal(back, w)
    b = torch.randn(E, 16)
    assert torch.equal(gmoe.fc1_glu_convert(gmoe.fc1_glu_convert(b, 0, block), block, 0), b)


# ---- opcheck: every op ------------------------------------------------------------------------

def _opcheck_cases():
    counts = routing("skewed_empty")
    x, w, b = torch.randn(CAP, K), torch.randn(E, N, K), torch.randn(E, N)
    dy = torch.randn(CAP, N)
    h = torch.randn(CAP, 32)
    probs = torch.rand(CAP)
    ops = torch.ops.gmoe
    return [
        (ops.grouped_gemm_fprop, (x, [w], counts, [b]), {}),
        (ops.grouped_gemm_fprop, (x, list(w.unbind(0)), counts, []), {"out_dtype": torch.float32}),
        (ops.grouped_gemm_dgrad, (dy, [w], counts), {}),
        (ops.grouped_gemm_wgrad, (dy, x, counts), {}),
        (ops.grouped_gemm_wgrad_, (dy, x, counts, [torch.zeros(E, N, K)]),
         {"accumulate": True, "expert_mask": torch.tensor([1, 0, 1, 1], dtype=torch.int32)}),
        (ops.grouped_bias_add, (dy, [b], counts), {}),
        (ops.grouped_bias_grad, (dy, counts), {}),
        (ops.grouped_activation_forward, (h, counts, "swiglu", probs), {}),
        (ops.grouped_activation_forward, (h, counts, "squared_relu"), {}),
        (ops.grouped_activation_backward, (h, torch.randn(CAP, 16), counts, "clamped_swiglu", probs),
         {"need_dprobs": True}),
        (ops.grouped_gemm_fprop_of_activation, (h, [torch.randn(E, N, 16)], counts, [b], "swiglu", probs), {}),
        (ops.grouped_gemm_fprop_of_activation, (torch.randn(CAP, 16), list(torch.randn(E, N, 16).unbind(0)), counts,
                                                [], "squared_relu"), {"glu_block": 0}),
        (ops.fc1_glu_convert, (torch.randn(E, 16, K), 0, 4), {}),
        (ops.check_device_errors, (x,), {}),
        # the expert mask: masked-off experts zeros in a new output, or fresh into fresh_dw (either layout)
        (ops.grouped_gemm_wgrad, (dy, x, counts), {"expert_mask": torch.tensor([1, 0, 0, 1], dtype=torch.int32)}),
        (ops.grouped_gemm_wgrad_, (dy, x, counts, [torch.zeros(E, N, K)]),
         {"accumulate": True, "expert_mask": torch.tensor([0, 1, 0, 1], dtype=torch.int32), "masked_off": "fresh",
          "fresh_dw": [torch.zeros(E, N, K)]}),
        (ops.grouped_gemm_wgrad_, (dy, x, counts, list(torch.zeros(E, N, K).unbind(0))),
         {"expert_mask": torch.tensor([1, 1, 0, 0], dtype=torch.int32), "masked_off": "fresh",
          "fresh_dw": list(torch.zeros(E, N, K).unbind(0))}),
    ]


@pytest.mark.parametrize("case", range(len(_opcheck_cases())))
def test_opcheck(case):
    op, args, kwargs = _opcheck_cases()[case]
    torch.library.opcheck(op, args, kwargs)


def _linear_forward_cases():
    """grouped_linear_forward with x, the weights, biases and probs requiring grad; main_grads and
    placeholders plain (each case: args, kwargs)."""
    counts = routing("skewed_empty")
    probs = torch.rand(CAP).requires_grad_()
    w = torch.randn(E, N, K).requires_grad_()
    b = torch.randn(E, N).requires_grad_()
    w_list = [t.requires_grad_() for t in torch.randn(E, N, K).unbind(0)]
    b_list = [t.requires_grad_() for t in torch.randn(E, N).unbind(0)]
    x = torch.randn(CAP, K).requires_grad_()
    h = torch.randn(CAP, 2 * K).requires_grad_()
    return [
        # placeholders of zeros (zero_out_wgrad): opcheck compares the gradients autograd gets
        ((x, [w], counts, [b], [torch.zeros(E, N, K)], [torch.zeros(E, N)], [torch.zeros(E, N, K)],
          [torch.zeros(E, N)]), {"accumulate": True}),
        ((x, w_list, counts, b_list, list(torch.zeros(E, N, K).unbind(0)), [], [], []), {"accumulate": False}),
        ((x, [w], counts, [b], [], [torch.zeros(E, N)], [], []), {"delay_wgrad": True}),
        ((h, [w], counts, [], [torch.zeros(E, N, K)], [], [], []), {"activation": "swiglu", "probs": probs}),
        ((x, [w], counts, [b], [torch.zeros(E, N, K)], [], [], []),
         {"expert_mask": torch.tensor([1, 0, 1, 0], dtype=torch.int32)}),
        ((x, w_list, counts, [], [], [], [], []), {"expert_mask": torch.tensor([0, 1, 1, 0], dtype=torch.int32)}),
    ]


@pytest.mark.parametrize("case", range(6))
def test_opcheck_linear_forward(case):
    args, kwargs = _linear_forward_cases()[case]
    torch.library.opcheck(torch.ops.gmoe.grouped_linear_forward, args, kwargs)


@pytest.mark.parametrize("case", [0, 7, 10, 11])
def test_opcheck_with_grad(case):
    op, args, kwargs = _opcheck_cases()[case]
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else
                 [t.requires_grad_() for t in a] if isinstance(a, list) else a for a in args)
    torch.library.opcheck(op, args, kwargs)


# ---- bad input: ValueError with gmoe's message, nothing written ---------------------------------

def test_debug_sync_switch():
    gmoe.set_debug_sync(True)
    gmoe.set_debug_sync(False)
    gmoe.check_device_errors("cpu")  # the CPU backend throws at once instead: nothing recorded


def test_bad_input_messages():
    counts = routing("uniform")
    x, w = torch.randn(CAP, K), torch.randn(E, N, K)
    with pytest.raises(ValueError, match="counts"):
        gmoe.grouped_gemm(x, w, counts[:3])  # counts of the wrong length
    with pytest.raises(ValueError, match="Double"):
        gmoe.grouped_gemm(x.double(), w.double(), counts)  # a dtype gmoe has none for
    with pytest.raises(ValueError, match="dtype"):
        gmoe.grouped_gemm(x.bfloat16(), w, counts)  # mixed dtypes
    with pytest.raises(ValueError, match=r"\[.*\]"):
        gmoe.grouped_gemm(x[:, :K - 1], w, counts)  # K mismatch
    with pytest.raises(ValueError):
        gmoe.grouped_gemm(torch.randn(K, CAP).T, w, counts)  # rows not contiguous
    with pytest.raises(ValueError, match="activation|kind|relu"):
        gmoe.grouped_activation(torch.randn(CAP, 8), counts, "relu3")
    with pytest.raises(ValueError, match="counts"):
        gmoe.grouped_gemm(x, w, torch.tensor([CAP, CAP, 0, 0], dtype=torch.int32))  # past capacity
    main_grad = torch.zeros(E, N, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="accumulate|f32"):
        gmoe.grouped_gemm_wgrad(torch.randn(CAP, N, dtype=torch.bfloat16), x.bfloat16(), counts, out=main_grad,
                                accumulate=True)
    assert torch.all(main_grad == 0)  # nothing written

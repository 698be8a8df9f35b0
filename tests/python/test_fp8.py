"""FP8 grouped quantization (every recipe, both formats) and the FP8 grouped GEMMs on CPU tensors:
round trips, the GEMMs against the bf16/f32 GEMM of the dequantized operands, opcheck."""
import pytest
import torch

import gmoe
import reference as ref

E, K, N, CAP, TOTAL = 4, 64, 48, 40, 33
RECIPES = ["tensorwise", "blockwise", "mxfp8"]


def counts_for(route="skewed_empty"):
    return ref.counts_tensor(ref.ROUTINGS[route](E, TOTAL))


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("route", list(ref.ROUTINGS))
def test_quantize_grouped_round_trip(recipe, fmt, route):
    counts = counts_for(route)
    total = int(counts.sum())
    x = torch.randn(CAP, K)
    q = gmoe.quantize_grouped(x, counts, recipe, fmt, rowwise=True, columnwise=True)
    assert q.data.dtype == (torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2)
    bound = 0.05 if fmt == "e4m3" else 0.1
    for columnwise in (False, True):
        back = gmoe.dequantize_grouped(q, counts, columnwise=columnwise)
        assert torch.all(back[total:] == 0)
        if total:
            assert rel_err(back[:total], x[:total]) < bound, (recipe, fmt, columnwise)


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_weights_round_trip(recipe):
    w = torch.randn(E, N, K)
    q = gmoe.quantize_weights(w, recipe)
    assert rel_err(gmoe.dequantize_weights(q), w) < 0.05
    assert rel_err(gmoe.dequantize_weights(q, transposed=True), w) < 0.05  # transposed back


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemms_are_the_gemms_of_the_dequantized_operands(recipe, with_bias):
    counts = counts_for()
    x, w, dy = torch.randn(CAP, K), torch.randn(E, N, K), torch.randn(CAP, N)
    b = torch.randn(E, N) if with_bias else None
    xq = gmoe.quantize_grouped(x, counts, recipe, rowwise=True, columnwise=True)
    dyq = gmoe.quantize_grouped(dy, counts, recipe, "e5m2", rowwise=True, columnwise=True)
    wq = gmoe.quantize_weights(w, recipe)
    x_deq, dy_deq = gmoe.dequantize_grouped(xq, counts), gmoe.dequantize_grouped(dyq, counts)
    w_deq = gmoe.dequantize_weights(wq)
    y = gmoe.fp8_grouped_gemm(xq, wq, counts, b)
    torch.testing.assert_close(y, gmoe.grouped_gemm(x_deq, w_deq, counts, b), rtol=1e-5, atol=1e-4)
    dx = gmoe.fp8_grouped_gemm_dgrad(dyq, wq, counts)
    w_t_deq = gmoe.dequantize_weights(wq, transposed=True)
    torch.testing.assert_close(dx, gmoe.grouped_gemm_dgrad(dy_deq, w_t_deq, counts), rtol=1e-5, atol=1e-4)
    dw = gmoe.fp8_grouped_gemm_wgrad(dyq, xq, counts)
    want = gmoe.grouped_gemm_wgrad(gmoe.dequantize_grouped(dyq, counts, columnwise=True),
                                   gmoe.dequantize_grouped(xq, counts, columnwise=True), counts)
    torch.testing.assert_close(dw, want, rtol=1e-5, atol=1e-4)
    main_grad = torch.ones(E, N, K)
    mask = torch.tensor([1, 1, 0, 1], dtype=torch.int32)
    gmoe.fp8_grouped_gemm_wgrad(dyq, xq, counts, out=main_grad, accumulate=True, expert_mask=mask)
    for e in range(E):
        torch.testing.assert_close(main_grad[e], (1 + dw[e]) if mask[e] else torch.ones(N, K), rtol=1e-5, atol=1e-4)


def test_fp8_bad_input():
    counts = counts_for()
    x = torch.randn(CAP, K)
    with pytest.raises(ValueError, match="recipe"):
        gmoe.quantize_grouped(x, counts, "rowwise")
    xq = gmoe.quantize_grouped(x, counts, "blockwise")
    wq = gmoe.quantize_weights(torch.randn(E, N, K), "tensorwise")
    with pytest.raises(ValueError, match="scale_inv|recipe"):
        gmoe.fp8_grouped_gemm(xq, wq, counts)  # recipes differ (the scales' layout shows it first)
    with pytest.raises(ValueError, match="columnwise|data_t"):
        gmoe.fp8_grouped_gemm_wgrad(xq, xq, counts)  # no columnwise copy


def _opcheck_cases():
    counts = counts_for()
    x, w = torch.randn(CAP, K), torch.randn(E, N, K)
    ops = torch.ops.gmoe
    mask = torch.tensor([1, 0, 0, 1], dtype=torch.int32)
    cases = []
    for recipe in RECIPES:
        xq = gmoe.quantize_grouped(x, counts, recipe, rowwise=True, columnwise=True)
        dyq = gmoe.quantize_grouped(torch.randn(CAP, N), counts, recipe, rowwise=True, columnwise=True)
        wq = gmoe.quantize_weights(w, recipe)
        cases += [
            (ops.quantize_grouped, (x, counts, recipe), {"format": "e5m2", "columnwise": True}),
            (ops.quantize_grouped, (x, counts, recipe), {"rowwise": False, "columnwise": True}),
            (ops.quantize_weights, ([w], recipe), {}),
            (ops.fp8_grouped_gemm_fprop, (xq.data, xq.scale_inv, wq.data, wq.scale_inv, counts, recipe, []), {}),
            (ops.fp8_grouped_gemm_dgrad, (dyq.data, dyq.scale_inv, wq.data_t, wq.scale_inv_t, counts, recipe), {}),
            (ops.fp8_grouped_gemm_wgrad, (dyq.data_t, dyq.scale_inv_t, xq.data_t, xq.scale_inv_t, xq.padded_offsets,
                                          counts, CAP, recipe), {}),
            (ops.fp8_grouped_gemm_wgrad_, (dyq.data_t, dyq.scale_inv_t, xq.data_t, xq.scale_inv_t,
                                           xq.padded_offsets, counts, CAP, recipe, [torch.zeros(E, N, K)]),
             {"accumulate": True}),
            (ops.fp8_grouped_gemm_wgrad, (dyq.data_t, dyq.scale_inv_t, xq.data_t, xq.scale_inv_t, xq.padded_offsets,
                                          counts, CAP, recipe), {"expert_mask": mask}),
            (ops.fp8_grouped_gemm_wgrad_, (dyq.data_t, dyq.scale_inv_t, xq.data_t, xq.scale_inv_t,
                                           xq.padded_offsets, counts, CAP, recipe, [torch.zeros(E, N, K)]),
             {"accumulate": True, "expert_mask": mask, "masked_off": "fresh", "fresh_dw": [torch.zeros(E, N, K)]}),
            (ops.dequantize_grouped, (*xq[:5], counts, CAP, K, recipe, True, torch.float32), {}),
            (ops.dequantize_weights, (wq.data_t, wq.scale_inv_t, True, recipe, torch.bfloat16), {}),
        ]
    return cases


# opcheck's test_schema compares tensors by arithmetic that torch does not implement for float8
# dtypes on the CPU ("mul_cpu_reduced_float"); the other checks (fake kernel against the real one,
# autograd registration, AOT dispatch with dynamic shapes) run.
FP8_OPCHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("case", range(33))
def test_opcheck_fp8(case):
    op, args, kwargs = _opcheck_cases()[case]
    torch.library.opcheck(op, args, kwargs, test_utils=FP8_OPCHECKS)


# ---- FP8 modules --------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_blockwise", "mxfp8"])
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_fp8_grouped_linear_is_the_fp8_ops(recipe, layout):
    torch.manual_seed(0)
    m = gmoe.GroupedLinear(E, K, N, bias=True, weight_layout=layout, recipe=recipe, grad_format="e5m2")
    counts = counts_for()
    x = torch.randn(CAP, K, requires_grad=True)
    dy = torch.randn(CAP, N)
    y = m(x, counts)
    y.backward(dy)
    r = gmoe.FP8_RECIPES[recipe]
    w = torch.stack(m._weights()) if layout == "per_expert" else m.weight
    b = torch.stack(m._biases()) if layout == "per_expert" else m.bias
    xq = gmoe.quantize_grouped(x.detach(), counts, r, rowwise=True, columnwise=True)
    wq = gmoe.quantize_weights(w.detach(), r)
    dyq = gmoe.quantize_grouped(dy, counts, r, "e5m2", rowwise=True, columnwise=True)
    assert torch.equal(y, gmoe.fp8_grouped_gemm(xq, wq, counts, b.detach()))
    assert torch.equal(x.grad, gmoe.fp8_grouped_gemm_dgrad(dyq, wq, counts))
    dw = gmoe.fp8_grouped_gemm_wgrad(dyq, xq, counts)
    assert torch.equal(torch.stack([p.grad for p in m._weights()]) if layout == "per_expert" else m.weight.grad, dw)
    # and close to the native layer
    native = gmoe.GroupedLinear(E, K, N, bias=True, weight_layout=layout)
    native.load_state_dict(m.state_dict())
    assert rel_err(y, native(x, counts)) < 0.1


def test_fp8_weight_cache_follows_optimizer_steps(monkeypatch):
    import gmoe.modules as mod

    calls = []
    real = mod.quantize_weights
    monkeypatch.setattr(mod, "quantize_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(1)
    m = gmoe.GroupedMLP(E, K, 32, recipe="fp8_blockwise", bias=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    counts = counts_for()
    x = torch.randn(CAP, K)
    y0 = m(x, counts)
    y1 = m(x, counts)
    assert len(calls) == 2 and torch.equal(y0, y1)  # one quantization per FC, then the cache
    y1.sum().backward()
    opt.step()
    y2 = m(x, counts)
    assert len(calls) == 4  # the step changed the weights: quantized again, without being told
    fresh = gmoe.GroupedMLP(E, K, 32, recipe="fp8_blockwise", bias=True)
    fresh.load_state_dict(m.state_dict())
    assert torch.equal(y2, fresh(x, counts))


def test_fp8_autocast_and_main_grad_delayed():
    torch.manual_seed(2)
    m = gmoe.GroupedMLP(E, K, 32, bias=True, delay_wgrad_compute=True)
    ref_m = gmoe.GroupedMLP(E, K, 32, bias=True, recipe="fp8_tensorwise")
    ref_m.load_state_dict(m.state_dict())
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape)
    counts = counts_for()
    x = torch.randn(CAP, K)
    probs = torch.rand(CAP)
    with gmoe.fp8_autocast("fp8_tensorwise"):
        y = m(x, counts, probs)
    y_ref = ref_m(x, counts, probs)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy)
    m.backward_dw()
    for p, q in zip(m.parameters(), ref_m.parameters()):
        assert p.grad is None and p.grad_added_to_main_grad
        torch.testing.assert_close(p.main_grad, q.grad.float())
    with pytest.raises(ValueError, match="recipe"):
        gmoe.fp8_autocast("fp4")

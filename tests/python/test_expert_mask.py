"""The expert mask of the weight gradient (Megatron / Transformer Engine partial accumulation) in the
package: the wgrad ops' expert_mask, masked_off ("skip"/"fresh") and fresh_dw, and GroupedLinear /
GroupedMLP / MoELayer's expert_mask and masked_off_wgrad, against a plain-torch gradient per expert.
Every expert's destination is checked: main_grad (added or overwritten), left untouched, or the
fresh masked_off_grad. CUDA variants run where a Hopper GPU and the CUDA dispatch are present."""
import pytest
import torch

import gmoe
import reference as ref
from test_cuda import _cuda_ready

E, H, FFN, CAP = 4, 16, 8, 30

# name -> (counts of E experts, mask); counts total 25 of CAP rows
MASKS = {
    "mixed": ([9, 0, 10, 6], [1, 0, 0, 1]),
    "all_off": ([9, 0, 10, 6], [0, 0, 0, 0]),
    "all_on": ([9, 0, 10, 6], [1, 1, 1, 1]),
    "empty_on": ([0, 15, 0, 10], [1, 0, 1, 0]),  # the experts masked on have no rows
    "no_rows": ([0, 0, 0, 0], [0, 1, 1, 0]),
}


def case(name, device="cpu"):
    counts, mask = MASKS[name]
    return (torch.tensor(counts, dtype=torch.int32, device=device),
            torch.tensor(mask, dtype=torch.int32, device=device))


def dw_reference(dy, x, counts):
    """dW_e = dy_eᵀ · x_e per expert, in float64 on the CPU (zeros for an expert without rows)."""
    o = ref.offsets(counts.tolist())
    dy, x = dy.double().cpu(), x.double().cpu()
    return torch.stack([dy[o[e]:o[e + 1]].T @ x[o[e]:o[e + 1]] for e in range(len(o) - 1)])


def as_layout(t, layout):
    return t if layout == "stacked" else list(t.unbind(0))


def stacked_of(ts):
    return ts if isinstance(ts, torch.Tensor) else torch.stack(ts)


def close(a, b, tol=1e-4):
    torch.testing.assert_close(a.double().cpu(), b.double().cpu(), rtol=tol, atol=tol)


# ---- the ops -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("masked_off", ["skip", "fresh"])
@pytest.mark.parametrize("out_layout,fresh_layout", [("stacked", "stacked"), ("list", "list"), ("stacked", "list")])
@pytest.mark.parametrize("accumulate", [True, False])
def test_op_every_expert_destination(name, masked_off, out_layout, fresh_layout, accumulate):
    counts, mask = case(name)
    dy, x = torch.randn(CAP, H), torch.randn(CAP, FFN)
    want = dw_reference(dy, x, counts)
    main_grad = torch.randn(E, H, FFN)
    before = main_grad.clone()
    fresh = torch.full((E, H, FFN), 7.0) if masked_off == "fresh" else None
    out = as_layout(main_grad, out_layout)
    ret = gmoe.grouped_gemm_wgrad(dy, x, counts, out=out, accumulate=accumulate, expert_mask=mask,
                                  masked_off=masked_off,
                                  fresh_out=None if fresh is None else as_layout(fresh, fresh_layout))
    assert ret is None
    for e in range(E):
        if mask[e]:
            close(main_grad[e], before[e] + want[e] if accumulate else want[e])
            if fresh is not None:
                assert torch.all(fresh[e] == 7.0), f"expert {e}: masked on, its fresh view was written"
        else:
            assert torch.equal(main_grad[e], before[e]), f"expert {e}: masked off, main_grad was written"
            if fresh is not None:
                close(fresh[e], want[e])  # overwritten, never accumulated (zeros without rows)


@pytest.mark.parametrize("name", ["mixed", "all_off", "empty_on"])
def test_op_fresh_returned_and_functional_zeros(name):
    counts, mask = case(name)
    dy, x = torch.randn(CAP, H), torch.randn(CAP, FFN)
    want = dw_reference(dy, x, counts)
    main_grad = torch.zeros(E, H, FFN)
    fresh = gmoe.grouped_gemm_wgrad(dy, x, counts, out=list(main_grad.unbind(0)), expert_mask=mask,
                                    masked_off="fresh")
    assert fresh.shape == (E, H, FFN) and fresh.dtype == torch.float32
    new = gmoe.grouped_gemm_wgrad(dy, x, counts, expert_mask=mask)  # no out: masked-off experts are zeros
    for e in range(E):
        if mask[e]:
            close(main_grad[e], want[e])
            close(new[e], want[e])
        else:
            close(fresh[e], want[e])
            assert torch.all(new[e] == 0)


def test_op_single_expert():
    counts, mask = torch.tensor([20], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    dy, x = torch.randn(CAP, H), torch.randn(CAP, FFN)
    main_grad = torch.randn(1, H, FFN)
    before = main_grad.clone()
    fresh = gmoe.grouped_gemm_wgrad(dy, x, counts, out=main_grad, accumulate=True, expert_mask=mask,
                                    masked_off="fresh")
    assert torch.equal(main_grad, before)
    close(fresh, dw_reference(dy, x, counts))
    gmoe.grouped_gemm_wgrad(dy, x, counts, out=main_grad, accumulate=True, expert_mask=1 - mask)
    close(main_grad, before + dw_reference(dy, x, counts))


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_op_fp8_fresh_matches_unmasked(recipe):
    """The FP8 weight gradient with a mask: every expert gets, in its destination, bitwise the
    gradient of the unmasked op."""
    K, N = 64, 48
    counts, mask = case("mixed")
    dyq = gmoe.quantize_grouped(torch.randn(CAP, N), counts, recipe, rowwise=False, columnwise=True)
    xq = gmoe.quantize_grouped(torch.randn(CAP, K), counts, recipe, rowwise=False, columnwise=True)
    full = gmoe.fp8_grouped_gemm_wgrad(dyq, xq, counts)
    main_grad = torch.randn(E, N, K)
    before = main_grad.clone()
    fresh = gmoe.fp8_grouped_gemm_wgrad(dyq, xq, counts, out=main_grad, accumulate=True, expert_mask=mask,
                                        masked_off="fresh")
    zeros = gmoe.fp8_grouped_gemm_wgrad(dyq, xq, counts, expert_mask=mask)
    for e in range(E):
        if mask[e]:
            assert torch.equal(main_grad[e], before[e] + full[e])
            assert torch.equal(zeros[e], full[e])
        else:
            assert torch.equal(main_grad[e], before[e])
            assert torch.equal(fresh[e], full[e])
            assert torch.all(zeros[e] == 0)


def test_op_bad_masks_name_the_argument():
    counts, mask = case("mixed")
    dy, x = torch.randn(CAP, H), torch.randn(CAP, FFN)
    main_grad = torch.zeros(E, H, FFN)
    for bad in (mask[:3], mask.long(), mask.float(), mask.view(2, 2)):
        with pytest.raises(ValueError, match="expert_mask"):
            gmoe.grouped_gemm_wgrad(dy, x, counts, out=main_grad, accumulate=True, expert_mask=bad)
        with pytest.raises(ValueError, match="expert_mask"):
            gmoe.grouped_gemm_wgrad(dy, x, counts, expert_mask=bad)
    with pytest.raises(ValueError, match="masked_off"):
        gmoe.grouped_gemm_wgrad(dy, x, counts, out=main_grad, expert_mask=mask, masked_off="drop")
    with pytest.raises(ValueError, match="expert_mask"):  # fresh without a mask
        gmoe.grouped_gemm_wgrad(dy, x, counts, out=main_grad, masked_off="fresh")
    with pytest.raises(ValueError, match="fresh_dw"):  # fresh_dw of the wrong shape
        gmoe.grouped_gemm_wgrad(dy, x, counts, out=main_grad, expert_mask=mask, masked_off="fresh",
                                fresh_out=torch.zeros(E, H, FFN + 1))
    with pytest.raises(ValueError, match="fresh_dw"):  # fresh_dw overlapping dw
        torch.ops.gmoe.grouped_gemm_wgrad_(dy, x, counts, [main_grad], False, mask, "fresh", [main_grad])
    assert torch.all(main_grad == 0)  # nothing written


# ---- the modules -------------------------------------------------------------------------------

def linear_reference_grads(m, x, counts, dy):
    """The weights' gradients [E, N, K] of the plain-torch layer with m's parameters."""
    weights = m._weights()
    w = weights[0] if len(weights) == 1 else torch.stack(weights)
    bias = m._biases()
    b = None if not bias else (bias[0] if len(bias) == 1 else torch.stack(bias))
    y = ref.grouped_linear(x, w, counts.tolist(), b)
    return torch.stack([g for g in torch.autograd.grad(y, weights, dy)]) if len(weights) > 1 else \
        torch.autograd.grad(y, weights, dy)[0]


def expect_fresh_destinations(fc, want, mask):
    """A stacked layer with a zeroed main_grad and 'fresh': the experts with mask 1 in main_grad,
    the others in masked_off_grad, main_grad left zero for them."""
    for e in range(len(mask)):
        if mask[e]:
            close(fc.weight.main_grad[e], want[e])
        else:
            assert torch.all(fc.weight.main_grad[e] == 0), f"expert {e}: masked off, main_grad was written"
            close(fc.weight.masked_off_grad[e], want[e])


def weight_grad(m, attr):
    ts = [getattr(w, attr) for w in m._weights()]
    return ts[0] if len(ts) == 1 else torch.stack(ts)


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("masked_off", ["skip", "fresh"])
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("accumulate", [True, False])
@pytest.mark.parametrize("delay", [False, True])
def test_linear_main_grad_every_expert(name, masked_off, layout, accumulate, delay):
    torch.manual_seed(7)
    counts, mask = case(name)
    m = gmoe.GroupedLinear(E, FFN, H, bias=True, weight_layout=layout, accumulate_main_grad=accumulate,
                           delay_wgrad_compute=delay, masked_off_wgrad=masked_off)
    m.expert_mask = mask
    for p in m.parameters():
        p.main_grad = torch.randn(p.shape)
    before = weight_grad(m, "main_grad").clone()
    bias_before = m.bias.main_grad.clone() if layout == "stacked" else None
    hook_saw = []
    m.register_wgrad_hook(lambda: hook_saw.append(all(hasattr(w, "masked_off_grad") for w in m._weights())))
    x, dy = torch.randn(CAP, FFN), torch.randn(CAP, H)
    m(x, counts).backward(dy)
    if delay:
        assert not hook_saw
        m.backward_dw()
    assert hook_saw == [masked_off == "fresh"]
    want = linear_reference_grads(m, x, counts, dy)
    got = weight_grad(m, "main_grad")
    for e in range(E):
        if mask[e]:
            close(got[e], before[e] + want[e] if accumulate else want[e])
        else:
            assert torch.equal(got[e], before[e]), f"expert {e}: masked off, main_grad was written"
            if masked_off == "fresh":
                close(weight_grad(m, "masked_off_grad")[e], want[e])
    for w in m._weights():
        assert w.grad is None and w.grad_added_to_main_grad
        if masked_off == "fresh":
            assert w.masked_off_grad.shape == w.shape and w.masked_off_grad.dtype == torch.float32
            if layout == "per_expert":  # views of one allocation, each on a 256-byte boundary
                assert w.masked_off_grad.data_ptr() % 256 == 0
        else:
            assert not hasattr(w, "masked_off_grad")
    if bias_before is not None:  # the biases are not masked
        o = ref.offsets(counts.tolist())
        db = torch.stack([dy[o[e]:o[e + 1]].sum(0) for e in range(E)])
        close(m.bias.main_grad, bias_before + db if accumulate else db)
    if masked_off == "fresh" and layout == "per_expert":
        ptrs = [w.masked_off_grad.untyped_storage().data_ptr() for w in m._weights()]
        assert len(set(ptrs)) == 1, "per-expert masked_off_grad views: expected one allocation"


@pytest.mark.parametrize("name", ["mixed", "all_off", "all_on", "empty_on"])
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("delay", [False, True])
def test_linear_param_grad_masked_off_experts_get_zero(name, layout, delay):
    torch.manual_seed(8)
    counts, mask = case(name)
    m = gmoe.GroupedLinear(E, FFN, H, bias=False, weight_layout=layout, delay_wgrad_compute=delay)
    m.expert_mask = mask
    x, dy = torch.randn(CAP, FFN), torch.randn(CAP, H)
    want = linear_reference_grads(m, x, counts, dy)
    for step in range(2):  # the second backward adds: masked-off experts keep the first one's (zero)
        m(x, counts).backward(dy)
        if delay:
            m.backward_dw()
        got = weight_grad(m, "grad")
        for e in range(E):
            close(got[e], (step + 1) * want[e] if mask[e] else torch.zeros_like(want[e]))


@pytest.mark.parametrize("accumulate", [True, False])
def test_linear_main_grad_on_some_experts_only(accumulate):
    """Per-expert weights of which only some have a main_grad: masked-off ones stay untouched
    there, and get a zero .grad elsewhere."""
    torch.manual_seed(16)
    counts, mask = case("mixed")  # mask [1, 0, 0, 1]
    m = gmoe.GroupedLinear(E, FFN, H, bias=False, weight_layout="per_expert", accumulate_main_grad=accumulate)
    m.expert_mask = mask
    with_main_grad = [0, 1]  # expert 0 masked on, expert 1 masked off
    for e in with_main_grad:
        m._weights()[e].main_grad = torch.randn(H, FFN)
    before = [m._weights()[e].main_grad.clone() for e in with_main_grad]
    x, dy = torch.randn(CAP, FFN), torch.randn(CAP, H)
    want = linear_reference_grads(m, x, counts, dy)
    m(x, counts).backward(dy)
    w = m._weights()
    close(w[0].main_grad, before[0] + want[0] if accumulate else want[0])
    assert torch.equal(w[1].main_grad, before[1])
    assert torch.all(w[2].grad == 0)
    close(w[3].grad, want[3])


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "mxfp8"])
@pytest.mark.parametrize("masked_off", ["skip", "fresh"])
def test_linear_fp8_recipe_masked(recipe, masked_off):
    """FP8 recipes: each expert's destination holds bitwise what the same layer gives it unmasked."""
    torch.manual_seed(9)
    counts, mask = case("mixed")
    K, N = 64, 32
    layers = [gmoe.GroupedLinear(E, K, N, bias=False, recipe=recipe, masked_off_wgrad=masked_off) for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    layers[1].expert_mask = mask
    for m in layers:
        m.weight.main_grad = torch.zeros(E, N, K)
    x, dy = torch.randn(CAP, K), torch.randn(CAP, N)
    for m in layers:
        m(x, counts).backward(dy)
    full, masked = layers[0].weight.main_grad, layers[1].weight.main_grad
    for e in range(E):
        if mask[e]:
            assert torch.equal(masked[e], full[e])
        else:
            assert torch.all(masked[e] == 0)
            if masked_off == "fresh":
                assert torch.equal(layers[1].weight.masked_off_grad[e], full[e])
    # without main_grad: masked-off experts get zeros in .grad
    for m in layers:
        del m.weight.main_grad
        m.masked_off_wgrad = "skip"
        m(x, counts).backward(dy)
    for e in range(E):
        want = layers[0].weight.grad[e] if mask[e] else torch.zeros_like(layers[0].weight.grad[e])
        assert torch.equal(layers[1].weight.grad[e], want)


def test_mlp_fresh_with_delay_and_hooks():
    torch.manual_seed(10)
    counts, mask = case("mixed")
    m = gmoe.GroupedMLP(E, H, FFN, bias=True, delay_wgrad_compute=True, masked_off_wgrad="fresh")
    plain = gmoe.GroupedMLP(E, H, FFN, bias=True)
    plain.load_state_dict(m.state_dict())
    m.expert_mask = mask
    assert m.fc1.expert_mask is mask and m.fc2.expert_mask is mask and m.fc2.masked_off_wgrad == "fresh"
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape)
    fresh_at_hook = []
    m.register_wgrad_hook(lambda: fresh_at_hook.append(m.fc1.weight.masked_off_grad.clone()))
    x, dy = torch.randn(CAP, H), torch.randn(CAP, H)
    m(x, counts).backward(dy)
    plain(x, counts).backward(dy)
    with pytest.raises(ValueError, match="backward_dw"):  # a second fresh backward while one is pending
        m(x, counts).backward(dy)
    m.fc1._state.pending.clear()
    m.fc2._state.pending.clear()
    m(x, counts).backward(dy)
    m.backward_dw()
    assert len(fresh_at_hook) == 1
    for fc, pfc in ((m.fc1, plain.fc1), (m.fc2, plain.fc2)):
        expect_fresh_destinations(fc, pfc.weight.grad, mask)
    for e in range(E):
        if not mask[e]:
            close(fresh_at_hook[0][e], plain.fc1.weight.grad[e])


def test_mlp_fresh_needs_main_grad_and_bad_masks():
    m = gmoe.GroupedMLP(E, H, FFN, masked_off_wgrad="fresh")
    counts, mask = case("mixed")
    m.expert_mask = mask
    with pytest.raises(ValueError, match="main_grad"):
        m(torch.randn(CAP, H), counts)
    with torch.no_grad():  # no weight gradient: nothing to refuse
        m(torch.randn(CAP, H), counts)
    for bad in (mask[:3], torch.ones(E + 1, dtype=torch.int32), mask.long(), mask.bool(), [1, 0, 1, 1]):
        with pytest.raises(ValueError, match="expert_mask"):
            m.expert_mask = bad
    assert m.expert_mask is mask  # a refused mask leaves the previous one
    with pytest.raises(ValueError, match="masked_off_wgrad"):
        m.masked_off_wgrad = "zero"
    with pytest.raises(ValueError, match="masked_off_wgrad"):
        gmoe.GroupedLinear(E, H, FFN, masked_off_wgrad="accumulate")
    m.masked_off_wgrad = "skip"
    m.expert_mask = mask.to("meta")  # a mask on another device than x
    with pytest.raises(ValueError, match="expert_mask"):
        m(torch.randn(CAP, H), counts)
    m.expert_mask = None
    m(torch.randn(CAP, H), counts).sum().backward()


def test_single_expert_layer():
    torch.manual_seed(11)
    m = gmoe.GroupedLinear(1, FFN, H, bias=False, masked_off_wgrad="fresh")
    m.weight.main_grad = torch.zeros(1, H, FFN)
    counts = torch.tensor([20], dtype=torch.int32)
    x, dy = torch.randn(CAP, FFN), torch.randn(CAP, H)
    want = linear_reference_grads(m, x, counts, dy)
    m.expert_mask = torch.zeros(1, dtype=torch.int32)
    m(x, counts).backward(dy)
    assert torch.all(m.weight.main_grad == 0)
    close(m.weight.masked_off_grad, want)
    m.expert_mask = torch.ones(1, dtype=torch.int32)
    m(x, counts).backward(dy)
    close(m.weight.main_grad, want)


def test_moe_layer_expert_mask():
    """MoELayer passes its expert_mask and masked_off_wgrad to the routed experts only; the routed
    experts' destinations match the unmasked layer's gradients, the shared experts' and the router's
    are unchanged."""
    torch.manual_seed(12)
    kw = dict(shared_expert_ffn_hidden_size=8, bias=True)
    m = gmoe.MoELayer(E, H, FFN, 2, masked_off_wgrad="fresh", **kw)
    plain = gmoe.MoELayer(E, H, FFN, 2, **kw)
    plain.load_state_dict(m.state_dict())
    mask = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    m.expert_mask = mask
    assert m.experts.fc2.expert_mask is mask and m.shared_experts.fc1.expert_mask is None
    assert m.experts.fc1.masked_off_wgrad == "fresh" and m.shared_experts.fc1.masked_off_wgrad == "skip"
    for p in m.experts.parameters():
        p.main_grad = torch.zeros(p.shape)
    x = torch.randn(3, 7, H)
    m(x).square().sum().backward()
    plain(x).square().sum().backward()
    for fc, pfc in ((m.experts.fc1, plain.experts.fc1), (m.experts.fc2, plain.experts.fc2)):
        expect_fresh_destinations(fc, pfc.weight.grad, mask)
        close(fc.bias.main_grad, pfc.bias.grad)
    close(m.router.weight.grad, plain.router.weight.grad)
    for p, q in zip(m.shared_experts.parameters(), plain.shared_experts.parameters()):
        close(p.grad, q.grad)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_with_mask(backend):
    """The plain path (param.grad) with a mask traces whole; a mask changed in place between calls
    is followed without a recompile of the values."""
    torch.manual_seed(13)
    m = gmoe.GroupedMLP(E, H, FFN, bias=True)
    counts, mask = case("mixed")
    m.expert_mask = mask
    compiled = torch.compile(m, fullgraph=True, backend=backend)
    x, dy = torch.randn(CAP, H), torch.randn(CAP, H)
    for new_mask in ([1, 0, 0, 1], [0, 1, 1, 1]):
        mask.copy_(torch.tensor(new_mask, dtype=torch.int32))
        compiled(x, counts).backward(dy)
        got = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        m(x, counts).backward(dy)
        for g, r in zip(got, [p.grad for p in m.parameters()]):
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)
        for fc in (m.fc1, m.fc2):
            for e in range(E):
                if not new_mask[e]:
                    assert torch.all(fc.weight.grad[e] == 0)
        m.zero_grad()


# ---- CUDA (skipped without a Hopper GPU and the extension's CUDA dispatch) ---------------------

cuda_only = pytest.mark.skipif(not _cuda_ready(), reason="needs a Hopper GPU and gmoe built with CUDA")
CE, CH, CF, CCAP = 8, 256, 128, 1024
CUDA_COUNTS = [300, 0, 0, 212, 0, 400, 0, 100]
CUDA_MASK = [1, 1, 0, 0, 1, 0, 0, 1]


@cuda_only
@pytest.mark.parametrize("out_layout,fresh_layout", [("stacked", "stacked"), ("list", "list"), ("list", "stacked")])
@pytest.mark.parametrize("accumulate", [True, False])
def test_cuda_op_every_expert_destination(out_layout, fresh_layout, accumulate):
    counts = torch.tensor(CUDA_COUNTS, dtype=torch.int32, device="cuda")
    mask = torch.tensor(CUDA_MASK, dtype=torch.int32, device="cuda")
    dy = torch.randn(CCAP, CH, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(CCAP, CF, device="cuda", dtype=torch.bfloat16)
    want = dw_reference(dy, x, counts).cuda()  # beside main_grad (before + want)
    main_grad = torch.randn(CE, CH, CF, device="cuda")
    before = main_grad.clone()
    fresh = torch.full((CE, CH, CF), 7.0, device="cuda")
    gmoe.grouped_gemm_wgrad(dy, x, counts, out=as_layout(main_grad, out_layout), accumulate=accumulate,
                            expert_mask=mask, masked_off="fresh", fresh_out=as_layout(fresh, fresh_layout))
    for e in range(CE):
        if CUDA_MASK[e]:
            close(main_grad[e], before[e] + want[e] if accumulate else want[e], tol=2e-2)
            assert torch.all(fresh[e] == 7.0)
        else:
            assert torch.equal(main_grad[e], before[e])
            close(fresh[e], want[e], tol=2e-2)
    zeros = gmoe.grouped_gemm_wgrad(dy, x, counts, expert_mask=mask, out_dtype=torch.float32)
    for e in range(CE):
        if not CUDA_MASK[e]:
            assert torch.all(zeros[e] == 0)


@cuda_only
def test_cuda_op_opcheck_and_mask_on_the_wrong_device():
    counts = torch.tensor(CUDA_COUNTS, dtype=torch.int32, device="cuda")
    mask = torch.tensor(CUDA_MASK, dtype=torch.int32, device="cuda")
    dy = torch.randn(CCAP, CH, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(CCAP, CF, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.gmoe.grouped_gemm_wgrad_, (dy, x, counts, [torch.zeros(CE, CH, CF, device="cuda")]),
                          {"accumulate": True, "expert_mask": mask, "masked_off": "fresh",
                           "fresh_dw": [torch.zeros(CE, CH, CF, device="cuda")]})
    main_grad = torch.zeros(CE, CH, CF, device="cuda")
    with pytest.raises(ValueError, match="expert_mask"):
        gmoe.grouped_gemm_wgrad(dy, x, counts, out=main_grad, accumulate=True, expert_mask=mask.cpu())
    m = gmoe.GroupedLinear(CE, CF, CH, device="cuda", dtype=torch.bfloat16)
    m.expert_mask = mask.cpu()
    with pytest.raises(ValueError, match="expert_mask"):
        m(x, counts)


@cuda_only
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("recipe", [None, "fp8_blockwise"])
def test_cuda_linear_fresh_matches_unmasked(layout, recipe):
    """The CUDA layers with main_grad and 'fresh': every expert's destination against the unmasked
    layer's main_grad."""
    torch.manual_seed(14)
    counts = torch.tensor(CUDA_COUNTS, dtype=torch.int32, device="cuda")
    mask = torch.tensor(CUDA_MASK, dtype=torch.int32, device="cuda")
    kw = dict(bias=True, weight_layout=layout, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    layers = [gmoe.GroupedLinear(CE, CF, CH, masked_off_wgrad="fresh", **kw), gmoe.GroupedLinear(CE, CF, CH, **kw)]
    layers[1].load_state_dict(layers[0].state_dict())
    layers[0].expert_mask = mask
    for m in layers:
        for p in m.parameters():
            p.main_grad = torch.zeros(p.shape, device="cuda")
    x = torch.randn(CCAP, CF, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(CCAP, CH, device="cuda", dtype=torch.bfloat16)
    for m in layers:
        m(x, counts).backward(dy)
    got, full = weight_grad(layers[0], "main_grad"), weight_grad(layers[1], "main_grad")
    fresh = weight_grad(layers[0], "masked_off_grad")
    # computed values within an f32 rounding of the unmasked layer's (as the C++ CUDA layer tests);
    # untouched memory bitwise
    for e in range(CE):
        if CUDA_MASK[e]:
            torch.testing.assert_close(got[e], full[e], rtol=1e-5, atol=1e-5)
        else:
            assert torch.all(got[e] == 0)
            torch.testing.assert_close(fresh[e], full[e], rtol=1e-5, atol=1e-5)


@cuda_only
def test_cuda_graph_replays_a_mask_updated_in_place():
    """A step (forward, backward, backward_dw into main_grad with fresh masked-off gradients)
    captured once follows the mask's new contents at every replay, bitwise equal to eager."""
    torch.manual_seed(15)
    counts = torch.tensor(CUDA_COUNTS, dtype=torch.int32, device="cuda")
    mask = torch.tensor(CUDA_MASK, dtype=torch.int32, device="cuda")
    m = gmoe.GroupedMLP(CE, CH, CF, bias=True, delay_wgrad_compute=True, masked_off_wgrad="fresh",
                        device="cuda", dtype=torch.bfloat16)
    m.expert_mask = mask
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape, device="cuda")
    x = torch.randn(CCAP, CH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(CCAP, CH, device="cuda", dtype=torch.bfloat16)

    def step():
        for p in m.parameters():
            p.main_grad.zero_()
        m(x, counts).backward(dy)
        m.backward_dw()
        return [m.fc1.weight.main_grad, m.fc2.weight.main_grad, m.fc1.weight.masked_off_grad,
                m.fc2.weight.masked_off_grad]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for new_mask in ([0] * CE, [1] * CE, [0, 1, 0, 1, 0, 1, 0, 1]):
        mask.copy_(torch.tensor(new_mask, dtype=torch.int32))
        graph.replay()
        replay = [t.clone() for t in static]
        eager = step()
        for i in range(2):  # main_grad: bitwise
            assert torch.equal(replay[i], eager[i]), f"{new_mask}: main_grad {i} differs"
        for i in range(2, 4):  # masked_off_grad: the experts with mask 0 (the others are not written)
            for e in range(CE):
                if not new_mask[e]:
                    assert torch.equal(replay[i][e], eager[i][e]), f"{new_mask}: masked_off_grad {i - 2}, expert {e}"

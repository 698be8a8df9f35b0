"""Token routing (gmoe.router_topk, aux / z losses, permute, combine) and gmoe.MoELayer against the
plain-torch block of reference.py (softmax / sigmoid top-k, group-limited top-k, argsort permute,
index_add combine): values, gradients, opcheck, the nasty cases (ties, tokens whose experts are all
dropped, E = 1, top_k = E, 0 tokens, padding), torch.compile, bad input. The CUDA tests at the end
(skipped without a Hopper GPU, as in test_cuda.py) capture a MoELayer training step in a CUDA graph
and replay it under changing routing bitwise equal to eager, with torch's sync debug mode on."""
import copy

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import gmoe
import reference as ref

ops = torch.ops.gmoe

# (score_func, normalize, n_group, topk_group, scaling_factor, with score_bias), E = 8, k = 3
ROUTERS = {
    "softmax": ("softmax", False, 1, 1, 1.0, False),
    "softmax_norm": ("softmax", True, 1, 1, 1.0, False),
    "sigmoid_bias_groups": ("sigmoid", True, 4, 2, 2.5, True),  # DeepSeek-V3's rule, scaled down
    "sigmoid_plain": ("sigmoid", False, 1, 1, 1.0, False),
    "softmax_groups": ("softmax", False, 2, 1, 1.0, False),
}


def router_args(name, E):
    score, normalize, n_group, topk_group, scale, with_bias = ROUTERS[name]
    bias = torch.randn(E) * 0.1 if with_bias else None
    return dict(score_func=score, normalize=normalize, n_group=n_group, topk_group=topk_group,
                scaling_factor=scale, score_bias=bias)


def check_router(logits, k, kw):
    """gmoe.router_topk against the reference: ids and counts exactly, probs and dlogits closely."""
    logits = logits.detach().requires_grad_()
    got = gmoe.router_topk(logits, k, **kw)
    lref = logits.detach().requires_grad_()
    ids, probs, counts = ref.router_topk(lref, k, **kw)
    assert got.ids.dtype == torch.int32 and got.counts.dtype == torch.int32
    assert torch.equal(got.ids, ids), (got.ids, ids)
    assert torch.equal(got.counts, counts)
    torch.testing.assert_close(got.probs, probs, rtol=1e-5, atol=1e-6)
    dprobs = torch.randn_like(probs)
    (g,) = torch.autograd.grad(got.probs, logits, dprobs, allow_unused=True)
    (r,) = torch.autograd.grad(probs, lref, dprobs, allow_unused=True)
    if r is None:  # no token: nothing flows
        assert g is None or g.numel() == 0
    else:
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)
    return got


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_topk(router, dtype):
    E, T, k = 8, 37, 3
    logits = torch.randn(T, E).to(dtype)
    check_router(logits, k, router_args(router, E))


@pytest.mark.parametrize("router", ["softmax", "sigmoid_bias_groups", "softmax_groups"])
def test_router_topk_ties_go_to_the_lower_id(router):
    E, T, k = 8, 40, 3
    # few distinct values: most tokens have ties across the k-th place, and whole rows are equal
    logits = torch.randint(0, 3, (T, E)).float()
    logits[:4] = 0.0
    kw = router_args(router, E)
    kw["score_bias"] = None if kw["score_bias"] is None else torch.zeros(E)
    got = check_router(logits, k, kw)
    assert got.ids[0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("E,k", [(1, 1), (5, 5), (8, 8)])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_router_topk_e1_and_k_equals_e(E, k, score):
    got = check_router(torch.randn(11, E), k, dict(score_func=score, normalize=True))
    assert torch.equal(got.counts, torch.full((E,), 11, dtype=torch.int32))


def test_router_topk_zero_tokens():
    got = check_router(torch.randn(0, 6), 2, dict(score_func="softmax"))
    assert got.ids.shape == (0, 2) and torch.equal(got.counts, torch.zeros(6, dtype=torch.int32))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("T", [0, 1, 29])
def test_aux_and_z_losses(score, T):
    E, k = 8, 2
    logits = torch.randn(T, E, requires_grad=True)
    _, _, counts = ref.router_topk(logits.detach(), k, score)
    aux = gmoe.router_aux_loss(logits, counts, k, 0.3, score_func=score)
    z = gmoe.router_z_loss(logits, 0.07)
    assert aux.shape == () and z.shape == () and aux.dtype == torch.float32
    aux_ref = ref.router_aux_loss(logits, counts, k, 0.3, score)
    z_ref = ref.router_z_loss(logits, 0.07)
    torch.testing.assert_close(aux, aux_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-7)
    if T == 0:
        assert aux.item() == 0 and z.item() == 0
        return
    for loss, loss_ref, scale in ((aux, aux_ref, 1.7), (z, z_ref, -0.4)):
        (g,) = torch.autograd.grad(loss * scale, logits)
        (r,) = torch.autograd.grad(loss_ref * scale, logits)
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-7)


def random_ids(T, E, k):
    """k distinct experts per token, random."""
    return torch.argsort(torch.rand(T, E), dim=1)[:, :k].int().contiguous()


def check_permute(x, ids, E, pad=1, capacity_factor=0.0, with_probs=True):
    """gmoe.permute against the argsort reference: the rows bitwise, the map and counts exactly,
    the gradients of x and probs. Returns gmoe's result."""
    T, k = ids.shape
    x = x.detach().requires_grad_()
    probs = torch.rand(T, k, requires_grad=True) if with_probs else None
    got = gmoe.permute(x, ids, E, probs, pad_multiple=pad, capacity_factor=capacity_factor)
    xr = x.detach().requires_grad_()
    pr = probs.detach().requires_grad_() if with_probs else None
    rows, counts, row_of, src_token, pprobs, dropped = ref.permute(xr, ids, E, pad, capacity_factor, pr)
    assert got.rows.shape[0] == gmoe.permuted_rows(T, k, E, pad, capacity_factor) == rows.shape[0]
    assert gmoe.permuted_rows(T, k, E, pad, capacity_factor) == ops.permuted_rows(T, k, E, pad, capacity_factor)
    assert torch.equal(got.rows, rows)
    assert torch.equal(got.counts, counts)
    assert torch.equal(got.map.row_of, row_of)
    assert torch.equal(got.map.src_token, src_token)
    assert got.dropped.tolist() == [dropped]
    if with_probs:
        assert torch.equal(got.probs, pprobs)
    else:
        assert got.probs is None
    drows = torch.randn_like(rows)
    inputs, ref_inputs, outs, ref_outs, grads = [x], [xr], [got.rows], [rows], [drows]
    if with_probs:
        inputs, ref_inputs = inputs + [probs], ref_inputs + [pr]
        outs, ref_outs, grads = outs + [got.probs], ref_outs + [pprobs], grads + [torch.randn_like(pprobs)]
    if rows.numel() or with_probs:
        for g, r in zip(torch.autograd.grad(outs, inputs, grads, allow_unused=True),
                        torch.autograd.grad(ref_outs, ref_inputs, grads, allow_unused=True)):
            if r is not None:
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    return got


@pytest.mark.parametrize("pad", [1, 4, 16])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5, 1.0, 1.3])
@pytest.mark.parametrize("with_probs", [False, True])
def test_permute(pad, capacity_factor, with_probs):
    E, T, H, k = 6, 31, 12, 2
    ids = random_ids(T, E, k)
    ids[:10, 0] = 2  # one crowded expert, so that the capacity drops
    ids[:10, 1] = 4
    got = check_permute(torch.randn(T, H), ids, E, pad, capacity_factor, with_probs)
    assert torch.all(got.counts % pad == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_permute_half_dtypes_copy_bitwise(dtype):
    check_permute(torch.randn(23, 16).to(dtype), random_ids(23, 4, 2), 4, pad=8)


def test_permute_token_with_all_experts_dropped():
    # capacity ceil(0.5·8·2/4) = 2 rows per expert: experts 0 and 1 keep tokens 0 and 2, and every
    # later token routed to them (3..7) loses both slots: its dx is 0 and combine gives it 0
    E, T, k, H = 4, 8, 2, 6
    ids = torch.tensor([[0, 1]] * T, dtype=torch.int32)
    ids[1] = torch.tensor([2, 3])
    got = check_permute(torch.randn(T, H), ids, E, pad=1, capacity_factor=0.5)
    assert (got.map.row_of[-1] == -1).all()
    y = torch.randn(got.rows.shape[0], H, requires_grad=True)
    out = gmoe.combine(y, got.map, torch.rand(T, k))
    assert torch.all(out[-1] == 0)
    x = torch.randn(T, H, requires_grad=True)
    p = gmoe.permute(x, ids, E, capacity_factor=0.5)
    p.rows.sum().backward()
    assert torch.all(x.grad[-1] == 0) and torch.all(x.grad[0] == 2)


@pytest.mark.parametrize("E,k", [(1, 1), (4, 4)])
def test_permute_e1_and_k_equals_e(E, k):
    T = 9
    got = check_permute(torch.randn(T, 5), random_ids(T, E, k), E, pad=4, capacity_factor=0.0)
    assert got.counts.tolist() == [12] * E


def test_permute_zero_tokens():
    got = check_permute(torch.randn(0, 5), torch.zeros(0, 2, dtype=torch.int32), 3, pad=4)
    assert got.rows.shape == (9, 5) and torch.all(got.rows == 0) and got.counts.tolist() == [0, 0, 0]
    out = gmoe.combine(got.rows, got.map, torch.rand(0, 2))
    assert out.shape == (0, 5)


@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine(with_probs, capacity_factor, dtype):
    E, T, H, k = 5, 27, 10, 3
    ids = random_ids(T, E, k)
    p = gmoe.permute(torch.randn(T, H), ids, E, pad_multiple=4, capacity_factor=capacity_factor)
    y = torch.randn(p.rows.shape[0], H).to(dtype).requires_grad_()
    probs = torch.rand(T, k, requires_grad=True) if with_probs else None
    out = gmoe.combine(y, p.map, probs)
    yr = y.detach().requires_grad_()
    pr = probs.detach().requires_grad_() if with_probs else None
    out_ref = ref.combine(yr, p.map.row_of, pr)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-6)
    else:  # both sum in f32 and round once; only the summation order differs
        torch.testing.assert_close(out.float(), out_ref.float(), rtol=1e-2, atol=1e-2)
    dout = torch.randn_like(out)
    inputs, ref_inputs = [y] + ([probs] if with_probs else []), [yr] + ([pr] if with_probs else [])
    for g, r in zip(torch.autograd.grad(out, inputs, dout), torch.autograd.grad(out_ref, ref_inputs, dout)):
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol)
    # padding rows and the rows of dropped slots get no gradient
    dy, _ = ops.combine_backward(dout, p.map.row_of, p.map.src_token, probs, None, False)
    assert torch.all(dy[p.map.src_token < 0] == 0)


def test_combine_is_deterministic():
    E, T, H, k = 8, 64, 32, 4
    p = gmoe.permute(torch.randn(T, H), random_ids(T, E, k), E)
    y, probs = torch.randn(p.rows.shape[0], H), torch.rand(T, k)
    assert torch.equal(gmoe.combine(y, p.map, probs), gmoe.combine(y, p.map, probs))


def test_opcheck_routing_ops():
    E, T, H, k = 6, 13, 8, 2
    logits = torch.randn(T, E, requires_grad=True)
    ids = random_ids(T, E, k)
    counts = torch.bincount(ids.flatten().long(), minlength=E).int()
    x = torch.randn(T, H, requires_grad=True)
    probs = torch.rand(T, k, requires_grad=True)
    bias = torch.randn(E)
    torch.library.opcheck(ops.router_topk, (logits, k, "sigmoid", True, 2, 1, 2.0, bias))
    torch.library.opcheck(ops.router_topk, (logits, k))
    torch.library.opcheck(ops.router_topk_backward, (logits.detach(), ids, torch.randn(T, k)))
    torch.library.opcheck(ops.router_aux_loss, (logits, counts, k, "softmax", 0.1))
    torch.library.opcheck(ops.router_aux_loss_backward, (logits.detach(), counts, torch.ones(1), k))
    torch.library.opcheck(ops.router_z_loss, (logits, 0.01))
    torch.library.opcheck(ops.router_z_loss_backward, (logits.detach(), torch.ones(1), 0.01))
    torch.library.opcheck(ops.permute, (x, ids, E, 4, 0.7, probs))
    torch.library.opcheck(ops.permute, (x, ids, E))
    rows, _, row_of, src_token, _, _ = ops.permute(x.detach(), ids, E, 4, 0.7)
    y = torch.randn(rows.shape[0], H, requires_grad=True)
    torch.library.opcheck(ops.permute_backward, (y.detach(), row_of, src_token, torch.randn(rows.shape[0])))
    torch.library.opcheck(ops.combine, (y, row_of, src_token, probs))
    torch.library.opcheck(ops.combine, (y, row_of, src_token))
    torch.library.opcheck(ops.combine_backward, (torch.randn(T, H), row_of, src_token, probs.detach(), y.detach(),
                                                 True))


def test_routing_bad_input_names_the_argument():
    E, T, H, k = 4, 6, 8, 2
    logits, x = torch.randn(T, E), torch.randn(T, H)
    with pytest.raises(ValueError, match="top_k"):
        gmoe.router_topk(logits, E + 1)  # k > E
    with pytest.raises(ValueError, match="score_func"):
        gmoe.router_topk(logits, k, score_func="relu")
    with pytest.raises(ValueError, match="logits"):
        gmoe.router_topk(torch.randn(E), k)
    with pytest.raises(ValueError, match="n_group"):
        gmoe.router_topk(logits, k, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        gmoe.router_topk(logits, k + 1, n_group=4, topk_group=2)  # 2 groups of 1 hold fewer than 3
    with pytest.raises(ValueError, match="score_bias"):
        gmoe.router_topk(logits, k, score_bias=torch.zeros(E + 1))
    bad = random_ids(T, E, k)
    bad[3, 1] = E  # an id out of range: the CPU backend sees it and throws
    with pytest.raises(ValueError, match="ids"):
        gmoe.permute(x, bad, E)
    bad[3, 1] = -1
    with pytest.raises(ValueError, match="ids"):
        gmoe.permute(x, bad, E)
    with pytest.raises(ValueError, match="ids"):
        gmoe.permute(x, random_ids(T + 1, E, k), E)  # rows differ from x's
    with pytest.raises(ValueError, match="ids"):
        gmoe.permute(x, random_ids(T, E, k).long(), E)  # int64 ids
    with pytest.raises(ValueError, match="pad_multiple"):
        gmoe.permute(x, random_ids(T, E, k), E, pad_multiple=0)
    with pytest.raises(ValueError, match="capacity_factor"):
        gmoe.permute(x, random_ids(T, E, k), E, capacity_factor=-1.0)
    p = gmoe.permute(x, random_ids(T, E, k), E)
    with pytest.raises(ValueError, match="probs"):
        gmoe.combine(p.rows, p.map, torch.rand(T, k + 1))
    with pytest.raises(ValueError, match="counts"):
        gmoe.router_aux_loss(logits, torch.zeros(E + 1, dtype=torch.int32), k)


# ---- MoELayer ---------------------------------------------------------------------------------------

def stacked(params):
    return params[0] if len(params) == 1 else torch.stack(params)


def mlp_ref(m, x, counts):
    b1, b2 = m.fc1._biases(), m.fc2._biases()
    return ref.mlp(x, counts, stacked(m.fc1._weights()), stacked(b1) if b1 else None, stacked(m.fc2._weights()),
                   stacked(b2) if b2 else None, m.activation, glu_block=m.glu_block, alpha=m.alpha, limit=m.limit,
                   gelu_tanh=m.gelu_tanh)


def moe_ref(m: gmoe.MoELayer, x):
    """The same block in plain torch from m's parameters: (out, aux_loss or None, counts)."""
    tokens = x.reshape(-1, m.hidden_size)
    logits = tokens.float() @ m.router.weight.float().T
    ids, probs, counts = ref.router_topk(logits, m.top_k, m.score_func, m.normalize_topk, m.n_group, m.topk_group,
                                         m.scaling_factor, m.score_correction_bias)
    rows, pcounts, row_of, _, _, _ = ref.permute(tokens, ids, m.num_experts, m.pad_multiple, m.capacity_factor)
    out = ref.combine(mlp_ref(m.experts, rows, pcounts.tolist()), row_of, probs)
    if m.shared_experts is not None:
        out = out + mlp_ref(m.shared_experts, tokens, [tokens.shape[0]])
    losses = []
    if m.aux_loss_coeff:
        losses.append(ref.router_aux_loss(logits, counts, m.top_k, m.aux_loss_coeff, m.score_func))
    if m.z_loss_coeff:
        losses.append(ref.router_z_loss(logits, m.z_loss_coeff))
    return out.view(x.shape), (sum(losses) if losses else None), counts


MOE_CASES = {
    "mixtral": dict(top_k=2, normalize_topk=True),
    "qwen_shared_losses": dict(top_k=3, aux_loss_coeff=0.01, z_loss_coeff=1e-3, shared_expert_ffn_hidden_size=12),
    "deepseek": dict(top_k=3, score_func="sigmoid", normalize_topk=True, n_group=4, topk_group=2, scaling_factor=2.5,
                     score_correction_bias=True, shared_expert_ffn_hidden_size=8, aux_loss_coeff=0.02),
    "capacity_padding": dict(top_k=2, pad_multiple=8, capacity_factor=0.75, aux_loss_coeff=0.1),
    "gptoss_bias_interleaved": dict(top_k=2, activation="clamped_swiglu", bias=True, glu_layout="interleaved:4",
                                    weight_layout="per_expert", z_loss_coeff=0.01),
    "squared_relu_all_experts": dict(top_k=8, activation="squared_relu", shared_expert_ffn_hidden_size=4),
}


def make_moe(case, E=8, H=16, F=8, **extra):
    kw = dict(MOE_CASES[case])
    top_k = kw.pop("top_k")
    kw.update(extra)
    torch.manual_seed(3)
    m = gmoe.MoELayer(E, H, F, top_k, **kw)
    if m.score_correction_bias is not None:
        m.score_correction_bias.copy_(torch.randn(E) * 0.05)
    return m


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_layer_matches_plain_torch(case):
    m = make_moe(case)
    x = torch.randn(3, 9, 16, requires_grad=True)
    y = m(x)
    assert y.shape == x.shape
    xr = x.detach().requires_grad_()
    y_ref, aux_ref, counts_ref = moe_ref(m, xr)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    assert m.last_counts.dtype == torch.int32 and torch.equal(m.last_counts, counts_ref)
    assert (m.aux_loss is None) == (aux_ref is None)
    dy = torch.randn_like(y)
    loss, loss_ref = (y * dy).sum(), (y_ref * dy).sum()
    if aux_ref is not None:
        assert m.aux_loss.shape == () and m.aux_loss.requires_grad
        torch.testing.assert_close(m.aux_loss, aux_ref, rtol=1e-5, atol=1e-7)
        loss, loss_ref = loss + 100 * m.aux_loss, loss_ref + 100 * aux_ref  # so its gradient shows
    params = [p for p in m.parameters()]
    names = ["x"] + [n for n, _ in m.named_parameters()]
    got = torch.autograd.grad(loss, [x] + params)
    want = torch.autograd.grad(loss_ref, [xr] + params, allow_unused=True)
    for name, g, r in zip(names, got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=lambda s: f"{name}: {s}")
    assert m.score_correction_bias is None or m.score_correction_bias.grad is None


@pytest.mark.parametrize("case", ["qwen_shared_losses", "deepseek"])
def test_moe_layer_bf16_tolerance(case):
    m = make_moe(case)  # .to(bfloat16) casts the score_correction_bias buffer too: the layer copes
    m_bf16 = copy.deepcopy(m).to(torch.bfloat16)
    x = torch.randn(40, 16)
    y = m_bf16(x.bfloat16())
    assert y.dtype == torch.bfloat16
    # the same routing (the router runs in f32 from bf16 weights in both), bf16 rounding in the experts
    m_f32 = copy.deepcopy(m_bf16).float()
    torch.testing.assert_close(y.float(), m_f32(x.bfloat16().float()), rtol=5e-2, atol=5e-2)
    assert torch.equal(m_bf16.last_counts, m_f32.last_counts)


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_blockwise", "mxfp8"])
def test_moe_layer_fp8_recipes(recipe):
    torch.manual_seed(4)
    kw = dict(pad_multiple=16, shared_expert_ffn_hidden_size=64, dtype=torch.bfloat16)
    native = gmoe.MoELayer(4, 128, 64, 2, **kw)
    fp8 = gmoe.MoELayer(4, 128, 64, 2, recipe=recipe, **kw)
    fp8.load_state_dict(native.state_dict())
    x = torch.randn(40, 128, dtype=torch.bfloat16, requires_grad=True)
    y, y8 = native(x), fp8(x)
    assert torch.equal(fp8.last_counts, native.last_counts)  # the router is not quantized
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(y8, y) < 0.15
    dy = torch.randn_like(y)
    for g8, g in zip(torch.autograd.grad(y8, [x] + list(fp8.parameters()), dy),
                     torch.autograd.grad(y, [x] + list(native.parameters()), dy)):
        assert rel(g8, g) < 0.2


def test_moe_layer_router_stays_float32_under_autocast():
    m = make_moe("deepseek")
    x = torch.randn(30, 16)
    y = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_autocast = m(x)  # the experts are gmoe ops (no autocast); the router's linear is kept in f32
    assert torch.equal(y_autocast, y)


def test_moe_layer_token_with_all_experts_dropped_gets_only_the_shared_path():
    m = make_moe("mixtral", capacity_factor=0.25, shared_expert_ffn_hidden_size=4)
    x = torch.randn(32, 16)
    x[-3:] = x[0]  # four tokens of one route; capacity ceil(0.25·32·2/8) = 2: the last two are dropped
    y = m(x)
    assert m.last_dropped.item() > 0
    y_ref, _, _ = moe_ref(m, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    shared_only = m.shared_experts(x, torch.tensor([32], dtype=torch.int32))
    torch.testing.assert_close(y[-1], shared_only[-1])


def test_moe_layer_zero_tokens_and_attributes():
    m = make_moe("qwen_shared_losses")
    x = torch.randn(0, 16, requires_grad=True)
    y = m(x)
    assert y.shape == (0, 16) and m.last_counts.tolist() == [0] * 8
    (y.sum() + m.aux_loss).backward()
    assert m.router.weight.grad is not None and torch.all(m.router.weight.grad == 0)
    assert gmoe.MoELayer(4, 8, 4, 1)(torch.randn(2, 8)) is not None
    plain = gmoe.MoELayer(4, 8, 4, 1)
    plain(torch.randn(5, 8))
    assert plain.aux_loss is None and plain.shared_experts is None and plain.score_correction_bias is None
    assert isinstance(plain.router, torch.nn.Linear) and plain.router.bias is None
    assert isinstance(plain.experts, gmoe.GroupedMLP)


def test_moe_layer_probs_in_experts_same_block_without_the_experts_output(monkeypatch):
    assert not make_moe("gptoss_bias_interleaved").probs_in_experts  # FC2's bias: the weighted combine
    m = make_moe("capacity_padding", H=64, F=16)
    assert m.probs_in_experts
    T, k, H = 40, 2, 64
    x = torch.randn(T, H, requires_grad=True)
    y, kept = ref.saved_bytes(m, x)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum() + m.aux_loss, [x] + list(m.parameters()))
    # The same layer through the weighted combine: the same block, the experts' output kept.
    monkeypatch.setattr(gmoe.MoELayer, "probs_in_experts", property(lambda self: False))
    y_w, kept_w = ref.saved_bytes(m, x)
    grads_w = torch.autograd.grad((y_w * dy).sum() + m.aux_loss, [x] + list(m.parameters()))
    torch.testing.assert_close(y, y_w, rtol=1e-5, atol=1e-6)
    for name, g, w in zip(["x"] + [n for n, _ in m.named_parameters()], grads, grads_w):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda s: f"{name}: {s}")
    rows = gmoe.permuted_rows(T, k, m.num_experts, m.pad_multiple, m.capacity_factor)
    # the weighted combine keeps the experts' output [rows, H] and the probabilities [T, k]; the
    # experts keep each row's probability [rows] instead
    assert kept_w - kept == rows * H * 4 + T * k * 4 - rows * 4


@pytest.mark.parametrize("case", ["qwen_shared_losses", "capacity_padding", "gptoss_bias_interleaved"])
def test_moe_layer_recompute_activation_keeps_less_same_bits(case):
    m = make_moe(case)
    r = make_moe(case, recompute_activation=True)
    assert r.experts.recompute_activation and not m.experts.recompute_activation
    assert r.shared_experts is None or r.shared_experts.recompute_activation
    T, F = 40, 8
    x = torch.randn(T, 16, requires_grad=True)
    dy = torch.randn(T, 16)
    results = []
    for layer in (m, r):
        y, kept = ref.saved_bytes(layer, x)
        loss = (y * dy).sum() + (layer.aux_loss if layer.aux_loss is not None else 0)
        results.append((y, kept, torch.autograd.grad(loss, [x] + list(layer.parameters()))))
    (y, kept, grads), (y_r, kept_r, grads_r) = results
    assert torch.equal(y_r, y)
    for g, g_r in zip(grads, grads_r):
        assert torch.equal(g_r, g)
    # neither the experts' z [rows, F] nor the shared experts' [T, F_shared] (float32) is kept
    rows = gmoe.permuted_rows(T, m.top_k, m.num_experts, m.pad_multiple, m.capacity_factor)
    shared = m.shared_experts.fc2.in_features if m.shared_experts is not None else 0
    assert kept - kept_r == (rows * F + T * shared) * 4


def _regather_pair(case, **extra):
    """The layer (regather_expert_input on: the default) and its copy that keeps the permuted rows."""
    m = make_moe(case, **extra)
    assert m.regather_expert_input
    keep = copy.deepcopy(m)
    keep.regather_expert_input = False
    return m, keep


def _step_bits(layer, x, dy, backward_dw=False):
    """y, the bytes saved for backward, and the gradients of x and every parameter (main_grad when set)."""
    y, kept = ref.saved_bytes(layer, x)
    loss = (y * dy).sum() + (layer.aux_loss if layer.aux_loss is not None else 0)
    params = list(layer.parameters())
    loss.backward()
    if backward_dw:
        layer.backward_dw()
    grads = [x.grad] + [p.main_grad if hasattr(p, "main_grad") else p.grad for p in params]
    return y.detach(), kept, grads


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_layer_regather_expert_input_same_bits_keeps_less(case, recompute):
    m, keep = _regather_pair(case, recompute_activation=recompute)
    T, H = 40, 16
    x = torch.randn(T, H)
    dy = torch.randn(T, H)
    got = _step_bits(m, x.clone().requires_grad_(), dy)
    want = _step_bits(keep, x.clone().requires_grad_(), dy)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[2], want[2]):
        assert (g is None and w is None) or torch.equal(g, w)
    # the permuted rows [rows, H] (float32) are not kept: x and the map, which the rest of the
    # block keeps anyway, gather them again
    rows = gmoe.permuted_rows(T, m.top_k, m.num_experts, m.pad_multiple, m.capacity_factor)
    assert want[1] - got[1] == rows * H * 4


class _DgradSeesRows(torch.utils._python_dispatch.TorchDispatchMode):
    """At each grouped_gemm_dgrad, whether the rows of the latest combine_backward are still alive."""

    def __init__(self):
        super().__init__()
        self.rows = None  # a weak reference to the latest combine_backward's rows
        self.alive_at_dgrad = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "gmoe" and name == "grouped_gemm_dgrad":
            self.alive_at_dgrad.append(self.rows is not None and not self.rows.expired())
        out = func(*args, **(kwargs or {}))
        if func.namespace == "gmoe" and name == "combine_backward":
            self.rows = StorageWeakRef(out[0].untyped_storage())
        return out


@pytest.mark.parametrize("path", ["ops", "main_grad"])
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("case", ["mixtral", "gptoss_bias_interleaved"])
def test_moe_layer_regathered_rows_freed_before_fc1_dgrad(case, recompute, path):
    # FC1's backward takes its weight gradient from the rows gathered again, then frees them before
    # dgrad makes dx of the same size: backward holds one of the two. Both of its backwards (in
    # python/csrc/autograd.cpp): the ops' own (grouped_gemm_fprop) and grouped_linear_forward's
    # (main_grad).
    # FC1's dgrad is the last; the latest combine_backward before it is the regather.
    m = make_moe(case, recompute_activation=recompute)
    if path == "main_grad":
        for p in m.experts.parameters():
            p.main_grad = torch.zeros(p.shape)
    x = torch.randn(40, 16, requires_grad=True)
    y = m(x)
    seen = _DgradSeesRows()
    with seen:
        y.sum().backward()
    assert len(seen.alive_at_dgrad) == 2, seen.alive_at_dgrad  # FC2's, then FC1's
    assert not seen.alive_at_dgrad[-1]


@pytest.mark.parametrize("shape", ["zero_tokens", "one_expert_all_tokens", "delayed_main_grad"])
def test_moe_layer_regather_expert_input_edge_cases(shape):
    m, keep = _regather_pair("capacity_padding", shared_expert_ffn_hidden_size=4)
    T = 0 if shape == "zero_tokens" else 24
    x = torch.randn(T, 16)
    if shape == "one_expert_all_tokens":
        x[:, 0] = 1.0
        for layer in (m, keep):
            with torch.no_grad():
                layer.router.weight[0, 0] = 100.0  # expert 0 first for every token, past its capacity
    delayed = shape == "delayed_main_grad"
    for layer in (m, keep):
        layer.delay_wgrad_compute = delayed
        if delayed:
            for n, p in layer.named_parameters():
                if "experts" in n:
                    p.main_grad = torch.zeros(p.shape)
    dy = torch.randn(T, 16)
    got = _step_bits(m, x.clone().requires_grad_(), dy, backward_dw=delayed)
    want = _step_bits(keep, x.clone().requires_grad_(), dy, backward_dw=delayed)
    if shape == "one_expert_all_tokens":
        assert m.last_counts[0].item() == T and m.last_dropped.item() > 0
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[2], want[2]):
        assert (g is None and w is None) or torch.equal(g, w)
    assert got[1] < want[1]


def test_moe_layer_bad_input_names_the_argument():
    for kw, name in ((dict(top_k=5), "top_k"), (dict(top_k=0), "top_k"), (dict(score_func="tanh"), "score_func"),
                     (dict(n_group=3), "n_group"), (dict(n_group=2, topk_group=3), "topk_group"),
                     (dict(pad_multiple=0), "pad_multiple"), (dict(capacity_factor=-1.0), "capacity_factor"),
                     (dict(activation="relu"), "activation"), (dict(shared_expert_ffn_hidden_size=-1),
                                                               "shared_expert_ffn_hidden_size"),
                     (dict(recipe="fp4"), "recipe"), (dict(weight_layout="x"), "weight_layout")):
        args = dict(top_k=2)
        args.update(kw)
        with pytest.raises(ValueError, match=name):
            gmoe.MoELayer(4, 8, 4, args.pop("top_k"), **args)
    m = gmoe.MoELayer(4, 8, 4, 2)
    with pytest.raises(ValueError, match="x"):
        m(torch.randn(3, 7))


@pytest.mark.parametrize("delay", [False, True])
def test_moe_layer_main_grad_and_delayed_wgrad(delay):
    m = make_moe("qwen_shared_losses")
    plain = copy.deepcopy(m)
    m.delay_wgrad_compute = delay
    assert m.delay_wgrad_compute == delay and m.shared_experts.fc2.delay_wgrad_compute == delay
    expert_params = [p for n, p in m.named_parameters() if "experts" in n]
    for p in expert_params:
        p.main_grad = torch.full(p.shape, 0.5)
    fired = []
    m.register_wgrad_hook(lambda: fired.append(1))
    x = torch.randn(20, 16)
    dy = torch.randn(20, 16)
    (m(x) * dy).sum().backward()
    (plain(x) * dy).sum().backward()
    if delay:
        assert not fired and all(torch.all(p.main_grad == 0.5) for p in expert_params)
        m.backward_dw()
    assert fired
    for (name, p), q in zip(m.named_parameters(), plain.parameters()):
        if "experts" in name:
            assert p.grad is None and p.grad_added_to_main_grad
            torch.testing.assert_close(p.main_grad, q.grad + 0.5, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_moe_layer_torch_compile_fullgraph():
    torch._dynamo.reset()

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)
            self.moe = make_moe("deepseek")

        def forward(self, x):
            y = x + self.moe(self.norm(x))
            return y, self.moe.aux_loss

    model = Block()
    compiled = torch.compile(copy.deepcopy(model), fullgraph=True)
    for _ in range(2):  # new inputs, new routing, the same graph
        x = torch.randn(2, 11, 16)
        y, aux = model(x)
        yc, auxc = compiled(x)
        torch.testing.assert_close(yc, y, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(auxc, aux)
        (y.square().sum() + aux).backward()
        (yc.square().sum() + auxc).backward()
        for (n, p), q in zip(model.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda s: f"{n}: {s}")
            p.grad = q.grad = None
    assert torch.equal(compiled.moe.last_counts, model.moe.last_counts)


# ---- CUDA (skipped without a Hopper GPU and the extension's CUDA dispatch) ---------------------------

def _cuda_ready():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("gmoe::permute", "CUDA")


cuda_only = pytest.mark.skipif(not _cuda_ready(), reason="needs a Hopper GPU and gmoe built with CUDA")


@cuda_only
@pytest.mark.parametrize("router", list(ROUTERS))
def test_cuda_router_matches_cpu(router):
    E, T, k = 8, 300, 3
    kw = router_args(router, E)
    logits = torch.randint(-4, 4, (T, E)).float() / 4  # ties
    logits[: T // 2] = torch.randn(T // 2, E)
    cpu = gmoe.router_topk(logits, k, **kw)
    kw_cuda = dict(kw, score_bias=None if kw["score_bias"] is None else kw["score_bias"].cuda())
    gpu = gmoe.router_topk(logits.cuda(), k, **kw_cuda)
    assert torch.equal(gpu.ids.cpu(), cpu.ids) and torch.equal(gpu.counts.cpu(), cpu.counts)
    torch.testing.assert_close(gpu.probs.cpu(), cpu.probs, rtol=1e-5, atol=1e-6)


@cuda_only
@pytest.mark.parametrize("pad,capacity_factor", [(1, 0.0), (16, 0.0), (128, 0.7)])
def test_cuda_permute_combine_match_cpu(pad, capacity_factor):
    E, T, H, k = 16, 500, 256, 4
    ids = random_ids(T, E, k)
    ids[:100, 0] = 3
    x = torch.randn(T, H, dtype=torch.bfloat16)
    probs = torch.rand(T, k)
    cpu = gmoe.permute(x, ids, E, probs, pad_multiple=pad, capacity_factor=capacity_factor)
    gpu = gmoe.permute(x.cuda(), ids.cuda(), E, probs.cuda(), pad_multiple=pad, capacity_factor=capacity_factor)
    for name, a, b in (("rows", gpu.rows, cpu.rows), ("counts", gpu.counts, cpu.counts),
                       ("row_of", gpu.map.row_of, cpu.map.row_of), ("src_token", gpu.map.src_token, cpu.map.src_token),
                       ("probs", gpu.probs, cpu.probs), ("dropped", gpu.dropped, cpu.dropped)):
        assert torch.equal(a.cpu(), b), name
    y = torch.randn(cpu.rows.shape[0], H, dtype=torch.bfloat16)
    torch.testing.assert_close(gmoe.combine(y.cuda(), gpu.map, probs.cuda()).cpu().float(),
                               gmoe.combine(y, cpu.map, probs).float(), rtol=1e-2, atol=1e-2)


@cuda_only
def test_cuda_opcheck_routing():
    E, T, H, k = 8, 64, 128, 2
    logits = torch.randn(T, E, device="cuda", requires_grad=True)
    ids = random_ids(T, E, k).cuda()
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, k, device="cuda", requires_grad=True)
    torch.library.opcheck(ops.router_topk, (logits, k, "sigmoid", True, 2, 1, 1.0, torch.zeros(E, device="cuda")))
    torch.library.opcheck(ops.router_aux_loss, (logits, torch.full((E,), T * k // E, dtype=torch.int32,
                                                                   device="cuda"), k))
    torch.library.opcheck(ops.router_z_loss, (logits, 0.01))
    torch.library.opcheck(ops.permute, (x, ids, E, 16, 0.0, probs))
    rows, _, row_of, src_token, _, _ = ops.permute(x.detach(), ids, E, 16)
    torch.library.opcheck(ops.combine, (rows.detach().requires_grad_(), row_of, src_token, probs))


@cuda_only
def test_cuda_out_of_range_ids_set_the_device_error_word():
    E, T, H = 4, 32, 128
    ids = random_ids(T, E, 2).cuda()
    ids[5, 1] = E + 3
    p = gmoe.permute(torch.randn(T, H, device="cuda", dtype=torch.bfloat16), ids, E)
    assert p.map.row_of[5, 1].item() == -1  # the slot is dropped, nothing written for it
    assert p.counts.sum().item() == T * 2 - 1
    with pytest.raises(ValueError, match="expert id"):
        gmoe.check_device_errors()
    gmoe.check_device_errors()


def _moe_cuda():
    torch.manual_seed(5)
    m = gmoe.MoELayer(8, 256, 128, 2, score_func="sigmoid", normalize_topk=True, n_group=4, topk_group=2,
                      score_correction_bias=True, pad_multiple=16, capacity_factor=1.25, aux_loss_coeff=0.01,
                      z_loss_coeff=1e-3, shared_expert_ffn_hidden_size=128, device="cuda", dtype=torch.bfloat16)
    m.delay_wgrad_compute = True
    for n, p in m.named_parameters():
        if "experts" in n:
            p.main_grad = torch.zeros(p.shape, device="cuda")
    return m


def _moe_step(m, x, dy):
    """forward, backward (with the aux loss; the experts' weight gradients into main_grad, delayed
    to backward_dw), an SGD step of the router and the experts. Returns (y, dx, counts)."""
    y = m(x)
    dx, drouter = torch.autograd.grad((y.float() * dy).sum() + m.aux_loss, [x, m.router.weight])
    m.backward_dw()
    with torch.no_grad():
        m.router.weight.add_(drouter, alpha=-1e-2)
        for p in m.parameters():
            if hasattr(p, "main_grad"):
                p.add_(p.main_grad.to(p.dtype), alpha=-1e-2)
                p.main_grad.zero_()
    return y, dx, m.last_counts


@cuda_only
@pytest.mark.parametrize("case", ["qwen_shared_losses", "deepseek", "capacity_padding"])
def test_cuda_moe_layer_matches_cpu(case):
    # The CUDA GEMMs need widths that are multiples of 8 (16-byte rows): the shared expert's too.
    extra = {"shared_expert_ffn_hidden_size": 64} if MOE_CASES[case].get("shared_expert_ffn_hidden_size") else {}
    m_cpu = make_moe(case, E=8, H=256, F=128, **extra).to(torch.bfloat16)
    m = copy.deepcopy(m_cpu).cuda()
    x = torch.randn(200, 256, dtype=torch.bfloat16, requires_grad=True)
    xc = x.detach().cuda().requires_grad_()
    y_cpu, y = m_cpu(x), m(xc)
    assert torch.equal(m.last_counts.cpu(), m_cpu.last_counts)
    torch.testing.assert_close(y.cpu().float(), y_cpu.float(), rtol=3e-2, atol=3e-2)
    dy = torch.randn(200, 256)
    loss_cpu = (y_cpu.float() * dy).sum() + (m_cpu.aux_loss if m_cpu.aux_loss is not None else 0)
    loss = (y.float() * dy.cuda()).sum() + (m.aux_loss if m.aux_loss is not None else 0)
    names = ["x"] + [n for n, _ in m.named_parameters()]
    got = torch.autograd.grad(loss, [xc] + list(m.parameters()))
    want = torch.autograd.grad(loss_cpu, [x] + list(m_cpu.parameters()))
    for name, g, r in zip(names, got, want):  # bf16 on both backends: relative Frobenius error
        err = (g.cpu().float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)
        assert err < 2e-2, f"{name}: relative error {err:.3g}"


@cuda_only
@pytest.mark.parametrize("case", ["qwen_shared_losses", "capacity_padding"])
def test_cuda_moe_layer_regather_expert_input_same_bits(case):
    # A shared expert keeps x in both layers (the router keeps a float32 copy of the bf16 x, not x):
    # the bytes differ by the permuted rows alone.
    m, keep = _regather_pair(case, E=8, H=256, F=128, recompute_activation=True, shared_expert_ffn_hidden_size=64)
    m, keep = m.to(torch.bfloat16).cuda(), keep.to(torch.bfloat16).cuda()
    x = torch.randn(200, 256, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(200, 256, dtype=torch.bfloat16, device="cuda")
    got = _step_bits(m, x.clone().requires_grad_(), dy)
    want = _step_bits(keep, x.clone().requires_grad_(), dy)
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[2], want[2]):
        assert (g is None and w is None) or torch.equal(g, w)
    rows = gmoe.permuted_rows(200, m.top_k, m.num_experts, m.pad_multiple, m.capacity_factor)
    assert want[1] - got[1] == rows * 256 * 2


@cuda_only
def test_cuda_moe_training_step_graph_replays_bitwise_under_changing_routing():
    m = _moe_cuda()
    state = copy.deepcopy(m.state_dict())
    T, H = 512, 256
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, H, device="cuda")

    def restore(bias=None):
        with torch.no_grad():
            m.load_state_dict(state)  # in place: the graph keeps reading the same parameters
            if bias is not None:
                m.score_correction_bias.copy_(bias)
            for p in m.parameters():
                if hasattr(p, "main_grad"):
                    p.main_grad.zero_()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        for _ in range(2):
            _moe_step(m, x, dy)
    torch.cuda.current_stream().wait_stream(side)
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # global capture mode: any sync inside fails the capture
        static = _moe_step(m, x, dy)

    # the last routing: a selection bias that sends every token to experts 0 and 1, past capacity
    biases = [None, None, torch.tensor([5.0, 5.0, 0, 0, 0, 0, 0, 0], device="cuda")]
    seen_counts = set()
    for i, bias in enumerate(biases):
        new_x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * (1 + i)
        new_dy = torch.randn_like(dy)
        restore(bias)
        with torch.no_grad():
            x.copy_(new_x)
            dy.copy_(new_dy)
        graph.replay()
        replay = [t.clone() for t in static] + [p.detach().clone() for p in m.parameters()]
        seen_counts.add(tuple(static[2].tolist()))

        restore(bias)
        xe = new_x.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = list(_moe_step(m, xe, new_dy))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager += [p.detach() for p in m.parameters()]
        for j, (a, b) in enumerate(zip(replay, eager)):
            assert torch.equal(a, b), f"replay {i}: output {j} differs between the replayed graph and eager"
    assert len(seen_counts) == 3  # the routing changed on every replay
    assert m.last_dropped.item() > 0  # and the last one dropped tokens

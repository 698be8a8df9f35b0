"""Expert parallelism in the package (gmoe.EpGroup, ep_plan / ep_dispatch / ep_combine, MoELayer with
ep_group) on the CPU backend: R ranks as threads of this process (EpGroup.local; the ops release
the GIL). The receive layout against a reference built from the header's formula, scalars moving
with their rows, combine as dispatch's exact reverse, both gradients, and the EP MoE layer against
the single-rank layer on the same global batch (forward and every gradient), with a routing where
one rank receives nothing; a group of size 1 is the single-rank path bitwise. The NCCL side runs in
tests/python/test_ep_cuda.py (2 GPUs)."""
import threading

import pytest
import torch

import gmoe

TIMEOUT_S = 120


def run_ranks(fn, size):
    """fn(rank) on `size` threads at once (the ops are collective); their results, or the first
    exception."""
    results, errors = [None] * size, [None] * size

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive(), "a rank did not finish: the collective ops hang"
    for e in errors:
        if e is not None:
            raise e
    return results


def receive_layout(counts, size):
    """The header's receive layout: for each rank r, the list of (source rank, source row) of its
    receive rows, in order."""
    E = len(counts[0])
    El = E // size
    src_start = [[sum(c[:g]) for g in range(E)] for c in counts]
    out = []
    for r in range(size):
        rows = []
        for e in range(El):
            g = r * El + e
            for s in range(size):
                rows += [(s, src_start[s][g] + j) for j in range(counts[s][g])]
        out.append(rows)
    return out


def test_a_local_group():
    groups = gmoe.EpGroup.local(3, num_experts=6, hidden=8, max_rows=5, dtype=torch.float32)
    assert [g.rank for g in groups] == [0, 1, 2]
    g = groups[1]
    assert (g.size, g.local_experts, g.recv_capacity, g.max_rows, g.num_experts, g.hidden) == (3, 2, 15, 5, 6, 8)
    assert g.dtype == torch.float32 and g.device == torch.device("cpu")
    assert "rank=1, size=3" in repr(g)
    for x in groups:
        x.close()
        x.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        gmoe.ep_plan(g, torch.zeros(6, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_recv_rows|max_rows|num_experts"):
        gmoe.EpGroup.local(2, num_experts=5, hidden=8, max_rows=5)  # E not a multiple of the size
    try:  # NCCL's unique id: 128 bytes with the NCCL backend, else a clear error
        assert torch.ops.gmoe.ep_unique_id().shape == (128,)
    except ValueError as e:
        assert "without the NCCL backend" in str(e)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("skew", [False, True])
def test_dispatch_and_combine_move_rows_as_the_header_says(size, skew):
    torch.manual_seed(size + 10 * skew)
    E, H, max_rows = 2 * size, 5, 11
    counts = []
    for s in range(size):
        if skew:  # every row goes to rank 0's experts; rank 1 receives nothing
            c = [0] * E
            c[s % 2] = max_rows - s
        else:
            c = torch.multinomial(torch.ones(E), max_rows - s, replacement=True).bincount(minlength=E).tolist()
        counts.append(c)
    rows = [torch.randn(max_rows, H, dtype=torch.bfloat16) for _ in range(size)]
    scalars = [torch.randn(max_rows) for _ in range(size)]
    groups = gmoe.EpGroup.local(size, num_experts=E, hidden=H, max_rows=max_rows)

    def rank(r):
        g = groups[r]
        plan = gmoe.ep_plan(g, torch.tensor(counts[r], dtype=torch.int32))
        recv = gmoe.ep_dispatch(g, plan, rows[r], scalars[r])
        back = gmoe.ep_combine(g, plan, recv.rows, recv.scalars)
        no_scalars = gmoe.ep_dispatch(g, plan, rows[r])
        return plan, recv, back, no_scalars

    out = run_ranks(rank, size)
    layout = receive_layout(counts, size)
    for r in range(size):
        plan, recv, back, no_scalars = out[r]
        assert plan.counts_all.tolist() == counts
        El = E // size
        assert plan.local_counts.tolist() == [sum(c[r * El + e] for c in counts) for e in range(El)]
        assert recv.rows.shape == (size * max_rows, H) and recv.scalars.shape == (size * max_rows,)
        n = len(layout[r])
        want = torch.stack([rows[s][j] for s, j in layout[r]]) if n else rows[0][:0]
        assert torch.equal(recv.rows[:n], want)
        assert torch.equal(recv.scalars[:n], torch.tensor([scalars[s][j].item() for s, j in layout[r]]))
        assert not recv.rows[n:].any() and not recv.scalars[n:].any()
        assert no_scalars.scalars is None and torch.equal(no_scalars.rows, recv.rows)
        total = sum(counts[r])
        assert torch.equal(back.rows[:total], rows[r][:total]) and not back.rows[total:].any()
        assert torch.equal(back.scalars[:total], scalars[r][:total])
    for g in groups:
        g.close()


def test_the_gradients_are_the_reverse_exchange():
    size, E, H, max_rows = 2, 4, 3, 7
    torch.manual_seed(3)
    counts = [[2, 1, 0, 3], [0, 4, 2, 1]]
    groups = gmoe.EpGroup.local(size, num_experts=E, hidden=H, max_rows=max_rows, dtype=torch.float32)
    x = [torch.randn(max_rows, H, requires_grad=True) for _ in range(size)]
    p = [torch.randn(max_rows, requires_grad=True) for _ in range(size)]
    w = [torch.randn(size * max_rows, H) for _ in range(size)]
    v = [torch.randn(size * max_rows) for _ in range(size)]

    def rank(r):
        g = groups[r]
        plan = gmoe.ep_plan(g, torch.tensor(counts[r], dtype=torch.int32))
        recv = gmoe.ep_dispatch(g, plan, x[r], p[r])
        # the formulas are C++ autograd kernels (python/csrc/autograd.cpp), not Python ones
        assert "EpExchangeFunction<true>" in recv.rows.grad_fn.name()
        ((recv.rows * w[r]).sum() + (recv.scalars * v[r]).sum()).backward()
        # combine's gradient: dispatch of the gradient
        y = torch.randn(size * max_rows, H, requires_grad=True)
        back = gmoe.ep_combine(g, plan, y)
        assert "EpExchangeFunction<false>" in back.rows.grad_fn.name()
        u = torch.randn(max_rows, H)
        (back.rows * u).sum().backward()
        # an output without a gradient: the reverse exchange still runs (collective), with zeros
        ps = torch.randn(max_rows, requires_grad=True)
        gmoe.ep_dispatch(g, plan, x[r].detach(), ps).rows.sum().backward()
        assert ps.grad is not None and not ps.grad.any()
        return y, u

    ys = run_ranks(rank, size)
    layout = receive_layout(counts, size)
    for r in range(size):
        gx, gp = torch.zeros(max_rows, H), torch.zeros(max_rows)
        for d in range(size):
            for i, (s, j) in enumerate(layout[d]):
                if s == r:
                    gx[j], gp[j] = w[d][i], v[d][i]
        assert torch.equal(x[r].grad, gx) and torch.equal(p[r].grad, gp)
        y, _ = ys[r]
        gy = torch.zeros_like(y)
        for i, (s, j) in enumerate(layout[r]):
            gy[i] = ys[s][1][j]
        assert torch.equal(y.grad, gy)


def make_layers(size, E, H, F, k, max_rows, **kw):
    """The single-rank layer and `size` EP layers sharing its weights (rank r: experts [r·El, ...))."""
    ref = gmoe.MoELayer(E, H, F, k, dtype=torch.float32, **kw)
    with torch.no_grad():
        for prm in ref.parameters():
            prm.normal_(0, 0.3)
    groups = gmoe.EpGroup.local(size, num_experts=E, hidden=H, max_rows=max_rows, dtype=torch.float32)
    El = E // size
    layers = []
    for g in groups:
        m = gmoe.MoELayer(E, H, F, k, dtype=torch.float32, ep_group=g, **kw)
        with torch.no_grad():
            m.router.weight.copy_(ref.router.weight)
            for name in ("fc1", "fc2"):
                dst = getattr(m.experts, name).weight
                dst.copy_(getattr(ref.experts, name).weight[g.rank * El:(g.rank + 1) * El])
        layers.append(m)
    return ref, layers, groups


@pytest.mark.parametrize("size,routing", [(2, "uniform"), (4, "uniform"), (2, "rank0_gets_all")])
def test_the_ep_layer_is_the_single_rank_layer_on_the_global_batch(size, routing):
    torch.manual_seed(size)
    E, H, F, k, T = 4 * size, 16, 8, 2, 9
    ref, layers, groups = make_layers(size, E, H, F, k, T * k, normalize_topk=True)
    x = torch.randn(size * T, H)
    if routing == "rank0_gets_all":
        x[:, 0] = 1.0
        with torch.no_grad():
            ref.router.weight[E // size:, 0] = -100.0  # only rank 0's experts are chosen
            for m in layers:
                m.router.weight.copy_(ref.router.weight)
    dout = torch.randn(size * T, H)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr)
    out_ref.backward(dout)

    def rank(r):
        xi = x[r * T:(r + 1) * T].clone().requires_grad_()
        out = layers[r](xi)
        out.backward(dout[r * T:(r + 1) * T])
        return out.detach(), xi.grad

    res = run_ranks(rank, size)
    out = torch.cat([o for o, _ in res])
    dx = torch.cat([d for _, d in res])
    # the same rows through the same experts in the same order per expert: bitwise
    assert torch.equal(out, out_ref.detach())
    assert torch.equal(dx, xr.grad)
    El = E // size
    for name in ("fc1", "fc2"):
        want = getattr(ref.experts, name).weight.grad
        got = torch.cat([getattr(m.experts, name).weight.grad for m in layers])
        assert torch.equal(got, want), name
    if routing == "rank0_gets_all":
        assert not torch.cat([m.experts.fc1.weight.grad for m in layers[1:]]).any()
    # the router is replicated: its gradient is the ranks' sum (a sum in another order: not bitwise)
    dr = sum(m.router.weight.grad for m in layers)
    torch.testing.assert_close(dr, ref.router.weight.grad, rtol=1e-5, atol=1e-6)
    for g in groups:
        g.close()


def _twin_layers(size, E, H, F, k, max_rows, routing, **kw):
    """Two sets of EP layers with the same weights, both with delay_wgrad_compute: the second with
    experts_wgrad_during_combine."""
    sets = []
    for overlap in (False, True):
        torch.manual_seed(100 + size)
        _, layers, groups = make_layers(size, E, H, F, k, max_rows, normalize_topk=True, **kw)
        for m in layers:
            m.delay_wgrad_compute = True
            m.experts_wgrad_during_combine = overlap
            if routing == "rank0_gets_all":
                with torch.no_grad():
                    m.router.weight[E // size:, 0] = -100.0  # only rank 0's experts are chosen
        sets.append((layers, groups))
    return sets


def _backward_then_dw(m, x, dout):
    """x's gradient, every parameter's gradient after backward_dw, and which experts' weight
    gradients backward had already computed."""
    xi = x.clone().requires_grad_()
    m(xi).backward(dout)
    in_backward = [getattr(m.experts, fc).weight.grad is not None for fc in ("fc1", "fc2")]
    m.backward_dw()
    grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return xi.grad, grads, in_backward


@pytest.mark.parametrize("size,routing,kw", [
    (2, "uniform", {}),
    (4, "rank0_gets_all", {}),  # three ranks' experts receive no row: empty weight gradients
    (2, "uniform", {"bias": True}),  # FC2's bias: the weighted combine, no scalars move
    (2, "uniform", {"shared_expert_ffn_hidden_size": 8}),  # left to backward_dw
])
def test_experts_wgrad_during_combine_is_the_plain_backward_bitwise(size, routing, kw):
    E, H, F, k, T = 4 * size, 16, 8, 2, 9
    (plain, groups_a), (ovl, groups_b) = _twin_layers(size, E, H, F, k, T * k, routing, **kw)
    torch.manual_seed(size)
    x, dout = torch.randn(size * T, H), torch.randn(size * T, H)
    if routing == "rank0_gets_all":
        x[:, 0] = 1.0

    def run(layers):
        return run_ranks(lambda r: _backward_then_dw(layers[r], x[r * T:(r + 1) * T], dout[r * T:(r + 1) * T]), size)

    want, got = run(plain), run(ovl)
    for r in range(size):
        assert torch.equal(got[r][0], want[r][0]), f"rank {r}: dx"
        assert got[r][1].keys() == want[r][1].keys()
        for name, g in want[r][1].items():
            assert torch.equal(got[r][1][name], g), f"rank {r}: {name}"
        assert want[r][2] == [False, False], "the plain backward computed delayed weight gradients"
        assert got[r][2] == [True, True], f"rank {r}: the experts' weight gradients were left to backward_dw"
        if "shared_expert_ffn_hidden_size" in kw:
            assert "shared_experts.fc1.weight" in got[r][1]
    if routing == "rank0_gets_all":
        assert not torch.cat([m.experts.fc1.weight.grad for m in ovl[1:]]).any()
    for g in groups_a + groups_b:
        g.close()


def test_experts_wgrad_during_combine_without_ep_and_without_delay():
    torch.manual_seed(11)
    E, H, F, k, T = 6, 16, 8, 2, 7
    layers = []
    for overlap in (False, True):
        torch.manual_seed(12)
        m = gmoe.MoELayer(E, H, F, k, dtype=torch.float32, experts_wgrad_during_combine=overlap)
        m.delay_wgrad_compute = True
        layers.append(m)
    x, dout = torch.randn(T, H), torch.randn(T, H)
    want, got = _backward_then_dw(layers[0], x, dout), _backward_then_dw(layers[1], x, dout)
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        assert torch.equal(got[1][name], g), name
    assert (want[2], got[2]) == ([False, False], [True, True])

    m = gmoe.MoELayer(E, H, F, k, dtype=torch.float32, experts_wgrad_during_combine=True)
    with pytest.raises(ValueError, match="experts_wgrad_during_combine: the experts' weight gradients are not delayed"):
        m(torch.randn(T, H))
    with torch.no_grad():  # nothing to overlap without a backward
        assert m(torch.randn(T, H)).shape == (T, H)


def test_an_ep_group_of_one_is_the_single_rank_path_bitwise():
    torch.manual_seed(5)
    E, H, F, k, T = 6, 16, 8, 3, 10
    ref, (m,), (g,) = make_layers(1, E, H, F, k, T * k)
    x = torch.randn(T, H)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = ref(a), m(b)
    assert torch.equal(out_a, out_b)
    out_a.sum().backward()
    out_b.sum().backward()
    assert torch.equal(a.grad, b.grad)
    for p, q in zip(ref.parameters(), m.parameters()):
        assert torch.equal(p.grad, q.grad)
    g.close()


def test_the_layer_refuses_a_group_that_does_not_fit():
    (g0, g1) = gmoe.EpGroup.local(2, num_experts=8, hidden=16, max_rows=10, dtype=torch.float32)
    with pytest.raises(ValueError, match="num_experts = 8"):
        gmoe.MoELayer(6, 16, 8, 2, dtype=torch.float32, ep_group=g0)
    with pytest.raises(ValueError, match="hidden = 16"):
        gmoe.MoELayer(8, 32, 8, 2, dtype=torch.float32, ep_group=g0)
    m = gmoe.MoELayer(8, 16, 8, 2, dtype=torch.float32, ep_group=g0)
    assert m.experts.fc1.weight.shape == (4, 16, 16)  # El = 4 experts, FC1 [El, 2F, H]
    assert "ep_size=2, ep_rank=0" in repr(m)
    with pytest.raises(ValueError, match="max_rows = 10, but this forward has 12 permuted rows"):
        m(torch.randn(6, 16))  # checked before any exchange: no rank waits
    bf16 = gmoe.MoELayer(8, 16, 8, 2, dtype=torch.bfloat16, ep_group=g0)
    with pytest.raises(ValueError, match="moves torch.float32 rows"):
        bf16(torch.randn(4, 16, dtype=torch.bfloat16))
    for g in (g0, g1):
        g.close()


def test_fewer_rows_than_max_rows_are_padded():
    torch.manual_seed(7)
    size, E, H, F, k, T = 2, 8, 16, 8, 2, 5
    ref, layers, groups = make_layers(size, E, H, F, k, 3 * T * k)  # room for 3x the rows
    x = torch.randn(size * T, H)
    out_ref = ref(x)
    res = run_ranks(lambda r: layers[r](x[r * T:(r + 1) * T]).detach(), size)
    assert torch.equal(torch.cat(res), out_ref.detach())
    for g in groups:
        g.close()


def test_the_fake_kernels_give_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    size, E, H, max_rows = 2, 6, 4, 5
    groups = gmoe.EpGroup.local(size, num_experts=E, hidden=H, max_rows=max_rows, dtype=torch.float32)
    ops = torch.ops.gmoe

    def real(r):
        g = groups[r]
        ca, lc = ops.ep_plan(g.handle, torch.tensor([1, 0, 2, 0, 1, 1], dtype=torch.int32))
        d = ops.ep_dispatch(g.handle, ca, lc, torch.randn(max_rows, H), torch.randn(max_rows))
        c = ops.ep_combine(g.handle, ca, lc, d[0])
        return [t.shape for t in (ca, lc, *d, *c)] + [t.dtype for t in (ca, lc, *d, *c)]

    want = run_ranks(real, size)[1]
    with FakeTensorMode():  # no exchange happens here: one rank alone
        g = groups[1]
        ca, lc = ops.ep_plan(g.handle, torch.empty(E, dtype=torch.int32))
        d = ops.ep_dispatch(g.handle, ca, lc, torch.empty(max_rows, H), torch.empty(max_rows))
        c = ops.ep_combine(g.handle, ca, lc, d[0])
        got = [t.shape for t in (ca, lc, *d, *c)] + [t.dtype for t in (ca, lc, *d, *c)]
    assert got == want
    for g in groups:
        g.close()


def _ep_forward(layers, x):
    size = len(layers)
    T = x.shape[0] // size
    return torch.cat(run_ranks(lambda r: layers[r](x[r * T:(r + 1) * T]).detach(), size))


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_checkpoints_across_ep_sizes(layout):
    torch.manual_seed(11)
    E, H, F, k, T = 8, 16, 8, 2, 6
    kw = dict(weight_layout=layout, bias=True, shared_expert_ffn_hidden_size=8)
    x = torch.randn(4 * T, H)

    def ep_layers(size):
        groups = gmoe.EpGroup.local(size, num_experts=E, hidden=H, max_rows=x.shape[0] // size * k,
                                    dtype=torch.float32)
        return [gmoe.MoELayer(E, H, F, k, dtype=torch.float32, ep_group=g, **kw) for g in groups], groups

    # EP = 2 with its own weights (replicated router and shared experts, sliced experts)
    two, g2 = ep_layers(2)
    with torch.no_grad():
        for name, p in two[0].named_parameters():
            p.normal_(0, 0.3)
            if not name.startswith("experts."):
                dict(two[1].named_parameters())[name].copy_(p)
        for p in two[1].experts.parameters():
            p.normal_(0, 0.3)
    out2 = _ep_forward(two, x)
    merged = gmoe.merge_ep_state_dicts([m.state_dict() for m in two])
    # EP = 2 saved, EP = 1 loaded: the same layer
    one = gmoe.MoELayer(E, H, F, k, dtype=torch.float32, **kw)
    one.load_state_dict(merged)
    assert torch.equal(one(x).detach(), out2)
    # EP = 1 saved, EP = 4 loaded (and EP = 2 merged, EP = 4 loaded: the same state)
    four, g4 = ep_layers(4)
    for m in four:
        m.load_state_dict(one.state_dict())
    assert torch.equal(_ep_forward(four, x), out2)
    for m in four:
        m.load_state_dict(merged)
    assert torch.equal(_ep_forward(four, x), out2)
    # a rank's own state dict loads back as it is
    again, g2b = ep_layers(2)
    for m, src in zip(again, two):
        m.load_state_dict(src.state_dict())
    assert torch.equal(_ep_forward(again, x), out2)
    for g in g2 + g4 + g2b:
        g.close()


def test_merge_refuses_ranks_that_disagree():
    a = {"router.weight": torch.ones(4, 2), "experts.fc1.weight": torch.ones(2, 3, 2)}
    b = {"router.weight": torch.zeros(4, 2), "experts.fc1.weight": torch.ones(2, 3, 2)}
    with pytest.raises(ValueError, match="router.weight differs between rank 0 and rank 1"):
        gmoe.merge_ep_state_dicts([a, b])
    with pytest.raises(ValueError, match="keys differ"):
        gmoe.merge_ep_state_dicts([a, {"router.weight": torch.ones(4, 2)}])
    merged = gmoe.merge_ep_state_dicts([a, dict(a, **{"experts.fc1.weight": 2 * torch.ones(2, 3, 2)})])
    assert merged["experts.fc1.weight"].shape == (4, 3, 2) and merged["experts.fc1.weight"][2:].eq(2).all()


def test_the_ep_layer_traces_with_fake_tensors():
    # torch.compile's view of the layer: forward and backward traced on fake tensors (no exchange
    # runs), the exchanges in the graph as gmoe ops: plan, dispatch, combine; then backward's reverse
    # of each, combine's (a dispatch) first
    from torch.func import functional_call
    from torch.fx.experimental.proxy_tensor import make_fx
    groups = gmoe.EpGroup.local(2, num_experts=8, hidden=16, max_rows=20, dtype=torch.float32)
    m = gmoe.MoELayer(8, 16, 8, 2, ep_group=groups[0], dtype=torch.float32)
    params = dict(m.named_parameters())

    def forward_backward(params, x):
        out = functional_call(m, params, (x,))
        return (out,) + torch.autograd.grad(out.sum(), [x] + list(params.values()))

    x = torch.randn(10, 16, requires_grad=True)
    gm = make_fx(forward_backward, tracing_mode="fake")(params, x)
    ops = [str(n.target) for n in gm.graph.nodes if "gmoe.ep_" in str(n.target)]
    assert ops == ["gmoe.ep_plan.default", "gmoe.ep_dispatch.default", "gmoe.ep_combine.default",
                   "gmoe.ep_dispatch.default", "gmoe.ep_combine.default"]
    outs = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    assert tuple(outs[0].meta["val"].shape) == (10, 16) and tuple(outs[1].meta["val"].shape) == (10, 16)
    for g in groups:
        g.close()

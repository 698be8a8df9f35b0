"""gmoe.GroupedLinear and gmoe.GroupedMLP on CPU: values and gradients against plain torch, the
Megatron conventions (main_grad, delayed weight gradients, hooks), checkpoints across the two
weight layouts, torch.compile(fullgraph=True)."""
import copy

import pytest
import torch

import gmoe
import reference as ref

E, H, FFN, CAP = 4, 16, 8, 30


def counts_for(route, total=25):
    return ref.counts_tensor(ref.ROUTINGS[route](E, total))


def stacked(params):
    """[E, ...] from a layer's parameter list (one stacked parameter, or E per-expert ones)."""
    if not params:
        return None
    return params[0] if len(params) == 1 else torch.stack(params)


def mlp_reference(m, x, counts, probs):
    """The same MLP in plain torch from m's parameters."""
    w1, w2 = stacked(m.fc1._weights()), stacked(m.fc2._weights())
    b1, b2 = stacked(m.fc1._biases()), stacked(m.fc2._biases())
    h = ref.grouped_linear(x, w1, counts.tolist(), b1)
    z = ref.grouped_activation(h, counts.tolist(), m.activation, probs, alpha=m.alpha, limit=m.limit,
                               gelu_tanh=m.gelu_tanh, glu_block=m.glu_block)
    return ref.grouped_linear(z, w2, counts.tolist(), b2)


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("route", list(ref.ROUTINGS))
def test_grouped_linear(layout, bias, route):
    torch.manual_seed(0)
    m = gmoe.GroupedLinear(E, H, FFN, bias=bias, weight_layout=layout)
    counts = counts_for(route)
    x = torch.randn(CAP, H, requires_grad=True)
    y = m(x, counts)
    params = list(m.parameters())
    w, b = stacked(m._weights()), stacked(m._biases())
    y_ref = ref.grouped_linear(x, w, counts.tolist(), b)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x] + params, dy)
    want = torch.autograd.grad(y_ref, [x] + params, dy)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activation,glu", [("swiglu", "concatenated"), ("swiglu", "interleaved:4"),
                                            ("geglu", "concatenated"), ("clamped_swiglu", "interleaved:8"),
                                            ("squared_relu", "concatenated")])
@pytest.mark.parametrize("with_probs", [False, True])
def test_grouped_mlp(activation, glu, with_probs):
    torch.manual_seed(1)
    m = gmoe.GroupedMLP(E, H, FFN, activation=activation, glu_layout=glu, bias=True, limit=1.5)
    counts = counts_for("skewed_empty")
    x = torch.randn(CAP, H, requires_grad=True)
    probs = torch.rand(CAP, requires_grad=True) if with_probs else None
    y = m(x, counts, probs)
    y_ref = mlp_reference(m, x, counts, probs)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    inputs = [x] + ([probs] if with_probs else []) + list(m.parameters())
    dy = torch.randn_like(y)
    for g, r in zip(torch.autograd.grad(y, inputs, dy), torch.autograd.grad(y_ref, inputs, dy)):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("accumulate", [True, False])
def test_main_grad(layout, accumulate):
    torch.manual_seed(2)
    m = gmoe.GroupedLinear(E, H, FFN, bias=True, weight_layout=layout, accumulate_main_grad=accumulate)
    plain = gmoe.GroupedLinear(E, H, FFN, bias=True, weight_layout=layout)
    plain.load_state_dict(m.state_dict())
    starts = {}
    for name, p in m.named_parameters():
        p.main_grad = torch.randn(p.shape)
        starts[name] = p.main_grad.clone()
    counts = counts_for("skewed_empty")
    x = torch.randn(CAP, H)
    dy = torch.randn(CAP, FFN)
    m(x, counts).backward(dy)
    plain(x, counts).backward(dy)
    for (name, p), q in zip(m.named_parameters(), plain.parameters()):
        assert p.grad is None, name  # Megatron: not materialised
        assert getattr(p, "grad_added_to_main_grad", False), name
        want = starts[name] + q.grad if accumulate else q.grad
        torch.testing.assert_close(p.main_grad, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("recipe", [None, "fp8_blockwise"])
def test_megatron_ddp_hooks_fire_with_main_grad(layout, recipe):
    """Megatron's DDP marks its parameters (grad_added_to_main_grad = False) and reduces gradients
    from hooks on their AccumulateGrad nodes: with main_grad those must still run, once per
    parameter and backward, and see grad_added_to_main_grad set (so they do not add the placeholder)."""
    torch.manual_seed(4)
    m = gmoe.GroupedLinear(E, 32, 48, bias=True, weight_layout=layout, recipe=recipe)
    plain = gmoe.GroupedLinear(E, 32, 48, bias=True, weight_layout=layout, recipe=recipe)
    plain.load_state_dict(m.state_dict())
    fired = []

    def hook(p):
        fired.append((id(p), p.grad_added_to_main_grad, p.grad is not None and p.grad.shape == p.shape))
        if not p.grad_added_to_main_grad:  # what Megatron's hook does with a real gradient
            p.main_grad.add_(p.grad)
        p.grad = None

    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape)
        p.grad_added_to_main_grad = False
        p.register_post_accumulate_grad_hook(hook)
    counts = counts_for("skewed_empty")
    x = torch.randn(CAP, 32)
    dy = torch.randn(CAP, 48)
    for step in range(2):
        for p in m.parameters():
            p.grad_added_to_main_grad = False
        m(x, counts).backward(dy)
    params = list(m.parameters())
    assert sorted(f[0] for f in fired) == sorted(id(p) for p in params for _ in range(2))
    assert all(added and same_shape for _, added, same_shape in fired)
    plain(x, counts).backward(dy)
    for p, q in zip(params, plain.parameters()):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, 2 * q.grad, rtol=1e-4, atol=1e-4)
    # Without Megatron's mark no placeholder is made (nothing for autograd to accumulate).
    other = gmoe.GroupedLinear(E, 32, 48, bias=True, weight_layout=layout, recipe=recipe)
    for p in other.parameters():
        p.main_grad = torch.zeros(p.shape)
    other(x, counts).backward(dy)
    assert all(p.grad is None for p in other.parameters())


@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("delay", [False, True])
def test_main_grad_microbatches_in_flight(layout, delay):
    """Two forwards before their backwards (gradient accumulation with pipelining): each backward
    adds its own gradients into main_grad, which the other one changed in between, through the
    C++ formula (grouped_linear_forward); the hooks see main_grad complete."""
    torch.manual_seed(6)
    m = gmoe.GroupedMLP(E, H, FFN, bias=True, weight_layout=layout, delay_wgrad_compute=delay)
    plain = gmoe.GroupedMLP(E, H, FFN, bias=True, weight_layout=layout)
    plain.load_state_dict(m.state_dict())
    starts = []
    for p in m.parameters():
        p.main_grad = torch.randn(p.shape)
        starts.append(p.main_grad.clone())
    seen = []
    m.register_wgrad_hook(lambda: seen.append(m.fc1.weight0.main_grad.clone() if layout == "per_expert"
                                              else m.fc1.weight.main_grad.clone()))
    batches = [(torch.randn(CAP, H), counts_for(r), torch.randn(CAP, H)) for r in ("skewed_empty", "one_expert")]
    ys = [m(x, c) for x, c, _ in batches]
    assert all("LinearFunction" in y.grad_fn.name() for y in ys)
    for i, (y, (_, _, dy)) in enumerate(zip(reversed(ys), reversed(batches))):
        y.backward(dy)
        if delay:
            assert len(seen) == i  # not before backward_dw
            m.backward_dw()
    for x, c, dy in batches:
        plain(x, c).backward(dy)
    assert len(seen) == 2
    for p, q, start in zip(m.parameters(), plain.parameters(), starts):
        torch.testing.assert_close(p.main_grad, start + q.grad, rtol=1e-5, atol=1e-5)
    first = m.fc1.weight0 if layout == "per_expert" else m.fc1.weight
    torch.testing.assert_close(seen[-1], first.main_grad)


def test_delayed_wgrad_and_hooks():
    torch.manual_seed(3)
    m = gmoe.GroupedMLP(E, H, FFN, bias=True, delay_wgrad_compute=True)
    plain = gmoe.GroupedMLP(E, H, FFN, bias=True)
    plain.load_state_dict(m.state_dict())
    calls = []
    m.register_wgrad_hook(lambda: calls.append(m.fc1.weight.grad is not None))
    counts = counts_for("uniform")
    x = torch.randn(CAP, H, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(CAP, H)
    m(x, counts).backward(dy)
    plain(x2, counts).backward(dy)
    assert m.fc1.weight.grad is None and m.fc2.weight.grad is None and not calls
    torch.testing.assert_close(x.grad, x2.grad)  # dx now
    torch.testing.assert_close(m.fc1.bias.grad, plain.fc1.bias.grad)  # dbias now
    m.backward_dw()
    assert calls == [True]
    for p, q in zip(m.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5)
    m.backward_dw()  # nothing pending: no hook call, nothing changes
    assert calls == [True]


def test_state_dict_across_layouts():
    torch.manual_seed(4)
    stacked = gmoe.GroupedMLP(E, H, FFN, bias=True, weight_layout="stacked")
    per = gmoe.GroupedMLP(E, H, FFN, bias=True, weight_layout="per_expert")
    per.load_state_dict(stacked.state_dict())
    assert "fc1.weight3" in per.state_dict() and "fc1.weight" in stacked.state_dict()
    for e in range(E):
        assert torch.equal(getattr(per.fc1, f"weight{e}"), stacked.fc1.weight[e])
        assert torch.equal(getattr(per.fc2, f"bias{e}"), stacked.fc2.bias[e])
    back = gmoe.GroupedMLP(E, H, FFN, bias=True, weight_layout="stacked")
    back.load_state_dict(per.state_dict())
    for p, q in zip(back.parameters(), stacked.parameters()):
        assert torch.equal(p, q)
    bad = {k: v for k, v in per.state_dict().items() if k != "fc1.weight2"}
    with pytest.raises(RuntimeError, match="weight"):
        gmoe.GroupedMLP(E, H, FFN, bias=True, weight_layout="stacked").load_state_dict(bad)


class _Block(torch.nn.Module):
    def __init__(self, recompute_activation=False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.experts = gmoe.GroupedMLP(E, H, FFN, activation="swiglu", bias=True,
                                       recompute_activation=recompute_activation)

    def forward(self, x, counts, probs):
        return x + self.experts(self.norm(x), counts, probs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("recompute", [False, True])
def test_torch_compile_fullgraph(backend, recompute):
    torch.manual_seed(5)
    model = _Block(recompute)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    counts = counts_for("skewed_empty")
    x = torch.randn(CAP, H, requires_grad=True)
    probs = torch.rand(CAP, requires_grad=True)
    y = compiled(x, counts, probs)
    y.sum().backward()
    grads = [x.grad, probs.grad] + [p.grad for p in model.parameters()]
    x.grad = probs.grad = None
    model.zero_grad()
    y_eager = model(x, counts, probs)
    y_eager.sum().backward()
    # inductor fuses the layer norm: the same values up to rounding
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, [x.grad, probs.grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_module_bad_input():
    m = gmoe.GroupedLinear(E, H, FFN)
    with pytest.raises(ValueError, match="counts"):
        m(torch.randn(CAP, H), torch.tensor([1, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="weight_layout"):
        gmoe.GroupedLinear(E, H, FFN, weight_layout="rows")
    with pytest.raises(ValueError, match="activation"):
        gmoe.GroupedMLP(E, H, FFN, activation="relu")


@pytest.mark.parametrize("as_list", [True, False])
def test_host_counts_list_or_tensor(as_list):
    """m_splits as a Python list (or a CPU int64 tensor) gives bitwise the values and gradients of
    the int32 tensor of the same counts, for GroupedLinear and GroupedMLP."""
    torch.manual_seed(3)
    counts = counts_for("skewed_empty")
    host = counts.tolist() if as_list else counts.to(torch.int64)
    for m in (gmoe.GroupedLinear(E, H, H, bias=True), gmoe.GroupedMLP(E, H, FFN, bias=True)):
        x = torch.randn(CAP, H, requires_grad=True)
        dy = torch.randn(CAP, H)
        ys = [m(x, c) for c in (counts, host)]
        torch.testing.assert_close(ys[1], ys[0], rtol=0, atol=0)
        inputs = [x] + list(m.parameters())
        for g, r in zip(torch.autograd.grad(ys[1], inputs, dy), torch.autograd.grad(ys[0], inputs, dy)):
            torch.testing.assert_close(g, r, rtol=0, atol=0)


# ---- recompute_activation: FC2's input rebuilt in backward, bitwise the kept path -----------------

def _with_recompute(m):
    """A copy of GroupedMLP m that recomputes its activation (same parameters and main_grads)."""
    r = copy.deepcopy(m)
    r.recompute_activation = True
    for p, q in zip(m.parameters(), r.parameters()):
        if hasattr(p, "main_grad"):
            q.main_grad = p.main_grad.clone()
    return r


def _run(m, x, counts, probs, dy):
    """y, the bytes autograd keeps, and the gradients of x, probs and the parameters (None where
    main_grad took them, whose main_grads are read by the caller)."""
    y, kept = ref.saved_bytes(m, x, counts, probs)
    inputs = [x] + ([probs] if probs is not None else []) + list(m.parameters())
    return y, kept, torch.autograd.grad(y, inputs, dy, allow_unused=True)


def _assert_bitwise(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), i
        assert g is None or torch.equal(g, w), i


@pytest.mark.parametrize("activation,glu,gelu_tanh", [("swiglu", "concatenated", False),
                                                      ("swiglu", "interleaved:4", False),
                                                      ("geglu", "concatenated", False), ("geglu", "interleaved:2", True),
                                                      ("clamped_swiglu", "interleaved:8", False),
                                                      ("squared_relu", "concatenated", False)])
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_grouped_mlp_recompute_activation_bitwise_and_keeps_less(activation, glu, gelu_tanh, with_probs, bias, layout):
    torch.manual_seed(11)
    m = gmoe.GroupedMLP(E, H, FFN, activation=activation, glu_layout=glu, gelu_tanh=gelu_tanh, bias=bias,
                        weight_layout=layout, limit=1.5)
    assert m.recompute_activation is False
    r = gmoe.GroupedMLP(E, H, FFN, activation=activation, glu_layout=glu, gelu_tanh=gelu_tanh, bias=bias,
                        weight_layout=layout, limit=1.5, recompute_activation=True)
    assert r.recompute_activation is True
    r.load_state_dict(m.state_dict())
    counts = counts_for("skewed_empty")
    x = torch.randn(CAP, H)
    x[-3:] = 40.0  # past the clamp limit and in GELU's tails
    x.requires_grad_()
    probs = torch.rand(CAP, requires_grad=True) if with_probs else None
    dy = torch.randn(CAP, H)
    y, kept, grads = _run(m, x, counts, probs, dy)
    y_r, kept_r, grads_r = _run(r, x, counts, probs, dy)
    assert torch.equal(y_r, y)
    _assert_bitwise(grads_r, grads)
    assert kept - kept_r == CAP * FFN * 4  # z [capacity, F] float32 is not kept


FP8_F = 32  # the FP8 recipes' blocks


@pytest.mark.parametrize("recipe", list(gmoe.modules.FP8_RECIPES))
@pytest.mark.parametrize("with_probs", [False, True])
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_grouped_mlp_recompute_activation_fp8_bitwise_and_keeps_less(recipe, with_probs, layout):
    torch.manual_seed(12)
    m = gmoe.GroupedMLP(E, FP8_F, FP8_F, activation="clamped_swiglu", bias=True, weight_layout=layout, recipe=recipe)
    r = _with_recompute(m)
    counts = ref.counts_tensor([13, 0, 40, 9])
    x = torch.randn(70, FP8_F, requires_grad=True)
    probs = torch.rand(70, requires_grad=True) if with_probs else None
    dy = torch.randn(70, FP8_F)
    y, kept, grads = _run(m, x, counts, probs, dy)
    y_r, kept_r, grads_r = _run(r, x, counts, probs, dy)
    assert torch.equal(y_r, y)
    _assert_bitwise(grads_r, grads)
    # FC2's columnwise FP8 copy of z is not kept (its rowwise copy never was)
    q = gmoe.fp8.quantize_grouped(torch.randn(70, FP8_F), counts, gmoe.modules.FP8_RECIPES[recipe], "e4m3",
                                  rowwise=True, columnwise=True)
    assert kept - kept_r == sum(t.untyped_storage().nbytes() for t in q[2:5])


@pytest.mark.parametrize("recipe", [None, "fp8_blockwise"])
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
@pytest.mark.parametrize("accumulate", [True, False])
def test_grouped_mlp_recompute_activation_delayed_wgrad_main_grad(recipe, layout, accumulate):
    """The rebuilt z waits for backward_dw: main_grads (and hooks) bitwise the kept path's."""
    torch.manual_seed(13)
    m = gmoe.GroupedMLP(E, FP8_F, FP8_F, bias=True, weight_layout=layout, recipe=recipe, delay_wgrad_compute=True,
                        accumulate_main_grad=accumulate)
    for p in m.parameters():
        p.main_grad = torch.randn(p.shape)
    r = _with_recompute(m)
    counts = ref.counts_tensor([0, 25, 17, 3])
    x = torch.randn(50, FP8_F, requires_grad=True)
    probs = torch.rand(50, requires_grad=True)
    dy = torch.randn(50, FP8_F)
    results = []
    for mlp in (m, r):
        calls = []
        mlp.register_wgrad_hook(lambda: calls.append(1))
        y = mlp(x, counts, probs)
        dx, dprobs = torch.autograd.grad(y, [x, probs], dy)
        assert not calls
        mlp.backward_dw()
        assert calls == [1]
        results.append([y, dx, dprobs] + [p.main_grad for p in mlp.parameters()])
    _assert_bitwise(results[1], results[0])
    assert all(p.grad is None for p in r.parameters())

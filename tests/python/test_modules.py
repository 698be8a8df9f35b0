"""gmoe.GroupedLinear and gmoe.GroupedMLP on CPU: values and gradients against plain torch, the
Megatron conventions (main_grad, delayed weight gradients, hooks), checkpoints across the two
weight layouts, torch.compile(fullgraph=True)."""
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
        fired.append((id(p), p.grad_added_to_main_grad, None if p.grad is None else tuple(p.grad.shape)))
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
    assert all(added and shape is not None for _, added, shape in fired)
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
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(H)
        self.experts = gmoe.GroupedMLP(E, H, FFN, activation="swiglu", bias=True)

    def forward(self, x, counts, probs):
        return x + self.experts(self.norm(x), counts, probs)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(backend):
    torch.manual_seed(5)
    model = _Block()
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

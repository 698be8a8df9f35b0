"""gmoe.offload_activations: the gmoe modules' saved activations moved to host memory during forward
and back in backward. CPU tests (an offload is a host copy, so the logic runs everywhere) and CUDA
tests (pinned memory, a copy stream, device memory given back; skipped without a Hopper GPU): every
output and gradient bitwise equal with and without offloading (every recipe, delayed weight
gradients, under torch.utils.checkpoint), parameters never moved, the last module kept, opt-out."""
import contextlib
import copy
import weakref

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

import gmoe

E, H, FFN, CAP = 4, 32, 16, 40


def _cuda_ready():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("gmoe::grouped_gemm_fprop", "CUDA")


needs_cuda = pytest.mark.skipif(not _cuda_ready(), reason="needs a Hopper GPU and gmoe built with CUDA")


class Stack(nn.Module):
    """Four GroupedMLPs, one after the other, with one optionally under torch.utils.checkpoint."""

    def __init__(self, layers=4, checkpointed=None, **kw):
        super().__init__()
        self.layers = nn.ModuleList([gmoe.GroupedMLP(E, H, FFN, **kw) for _ in range(layers)])
        self.checkpointed = checkpointed

    def forward(self, x, counts, probs=None):
        for i, m in enumerate(self.layers):
            if i == self.checkpointed:
                x = ckpt.checkpoint(m, x, counts, probs, use_reentrant=False)
            else:
                x = m(x, counts, probs)
        return x


def _counts(device="cpu"):
    return torch.tensor([12, 0, 20, 5], dtype=torch.int64, device=device)


def _step(model, x, counts, dy, probs=None, offload=None, delayed=False):
    x = x.detach().clone().requires_grad_()
    p = probs.detach().clone().requires_grad_() if probs is not None else None
    if offload is not None:
        with offload:
            y = model(x, counts, p)
    else:
        y = model(x, counts, p)
    y.backward(dy)
    if delayed:
        for m in model.modules():
            if isinstance(m, gmoe.GroupedMLP):
                m.backward_dw()
    out = [y.detach(), x.grad] + ([p.grad] if p is not None else [])
    out += [q.grad for q in model.parameters()]
    return out


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert u is not None and v is not None, i
        assert torch.equal(u, v), f"output {i} differs"


def _pair(device="cpu", dtype=torch.float32, **kw):
    torch.manual_seed(7)
    model = Stack(**kw).to(device=device, dtype=dtype)
    twin = copy.deepcopy(model)
    x = torch.randn(CAP, H, device=device, dtype=dtype)
    dy = torch.randn(CAP, H, device=device, dtype=dtype)
    probs = torch.rand(CAP, device=device)
    return model, twin, x, dy, probs


@pytest.mark.parametrize("kw", [dict(), dict(bias=True), dict(delay_wgrad_compute=True),
                                dict(recompute_activation=True, delay_wgrad_compute=True)],
                         ids=["plain", "bias", "delayed", "recompute_delayed"])
def test_stack_bitwise_equal_and_counts(kw):
    model, twin, x, dy, probs = _pair(**kw)
    delayed = kw.get("delay_wgrad_compute", False)
    base = _step(twin, x, _counts(), dy, probs, delayed=delayed)
    off = gmoe.offload_activations(model)
    got = _step(model, x, _counts(), dy, probs, offload=off, delayed=delayed)
    _assert_bitwise(base, got)
    s = off.stats
    assert s.tensors_offloaded > 0 and s.bytes_offloaded > 0
    assert s.tensors_reloaded == s.tensors_offloaded, "every offloaded tensor comes back in backward"
    assert s.tensors_kept > 0, "the parameters (and the last layer) stay"


@pytest.mark.parametrize("delayed", [False, True])
def test_fc2_input_released_after_forward(delayed):
    """FC2's input z (the activation's output, kept for FC2's weight gradient, by the layer itself
    with delay_wgrad_compute) is offloaded: nothing on the device holds it after forward, and the
    gradients are bitwise those without offloading."""
    model, twin, x, dy, probs = _pair(layers=1, delay_wgrad_compute=delayed)
    kept = []
    model.layers[0].fc2.register_forward_pre_hook(lambda m, args: kept.append(weakref.ref(args[0])))
    off = gmoe.offload_activations(model, keep_last=False)
    xi = x.detach().clone().requires_grad_()
    with off:
        y = model(xi, _counts(), probs)
    assert kept and kept[0]() is None, "FC2's input is still alive after an offloaded forward"
    y.backward(dy)
    if delayed:
        model.layers[0].backward_dw()
    base = _step(twin, x, _counts(), dy, probs, delayed=delayed)
    _assert_bitwise(base[:2] + base[3:], [y.detach(), xi.grad] + [q.grad for q in model.parameters()])


def test_recompute_activation_offloads_less():
    """With recompute_activation, z is not saved, so not offloaded, and h is saved (and moved) once."""
    model, twin, x, dy, probs = _pair()
    for m in twin.layers:
        m.recompute_activation = True
    off, off_r = gmoe.offload_activations(model), gmoe.offload_activations(twin)
    base = _step(model, x, _counts(), dy, probs, offload=off)
    _assert_bitwise(_step(twin, x, _counts(), dy, probs, offload=off_r), base)
    # every layer but the last (kept on the device) offloads z [CAP, FFN] float32 without recompute,
    # and the counts [E] int64 once more (the activation's own save)
    assert off.stats.bytes_offloaded - off_r.stats.bytes_offloaded == (len(model.layers) - 1) * (CAP * FFN * 4 + E * 8)


def test_parameters_never_offloaded_and_last_kept():
    model, _, x, dy, probs = _pair(layers=2)
    seen = []
    off = gmoe.offload_activations(model)
    pack = off._pack

    def spy(t):
        r = pack(t)
        seen.append((off._active, t, r))
        return r

    off._pack = spy
    _step(model, x, _counts(), dy, probs, offload=off)
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    moved = [(m, t) for m, t, r in seen if r is not t]
    assert moved, "something is offloaded"
    assert all(t.untyped_storage().data_ptr() not in params for _, t in moved)
    assert all(m is model.layers[0] for m, _ in moved), "only the first layer: the last one stays"
    off_all = gmoe.offload_activations(model, keep_last=False)
    _step(model, x, _counts(), dy, probs, offload=off_all)
    assert off_all.stats.tensors_offloaded > off.stats.tensors_offloaded


def test_opt_out_and_outside_modules():
    model, _, x, dy, probs = _pair()
    for m in model.layers:
        m.offload_activations = False
    off = gmoe.offload_activations(model)
    _step(model, x, _counts(), dy, probs, offload=off)
    assert off.stats.tensors_offloaded == 0
    # Tensors saved outside gmoe modules are never touched.
    plain = nn.Linear(H, H)
    with gmoe.offload_activations(model) as o2:
        plain(x.requires_grad_()).sum().backward()
    assert o2.stats.tensors_offloaded == 0 and o2.stats.tensors_kept == 0


def test_with_activation_checkpointing():
    model, twin, x, dy, probs = _pair(checkpointed=1)
    base = _step(twin, x, _counts(), dy, probs)
    off = gmoe.offload_activations(model)
    got = _step(model, x, _counts(), dy, probs, offload=off)
    _assert_bitwise(base, got)
    # The checkpointed layer saves nothing to offload: fewer tensors than without checkpointing.
    model2, _, _, _, _ = _pair()
    off2 = gmoe.offload_activations(model2)
    _step(model2, x, _counts(), dy, probs, offload=off2)
    assert 0 < off.stats.tensors_offloaded < off2.stats.tensors_offloaded


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_blockwise", "mxfp8"])
def test_fp8_recipes_cpu(recipe):
    model, twin, x, dy, probs = _pair(layers=3)
    base_ctx, off_ctx = gmoe.fp8_autocast(recipe), gmoe.fp8_autocast(recipe)
    with base_ctx:
        base = _step(twin, x, _counts(), dy, probs)
    off = gmoe.offload_activations(model)
    with off_ctx:
        got = _step(model, x, _counts(), dy, probs, offload=off)
    _assert_bitwise(base, got)
    assert off.stats.tensors_offloaded > 0


def test_moe_layer_cpu():
    torch.manual_seed(3)
    layer = gmoe.MoELayer(E, H, FFN, top_k=2)
    twin = copy.deepcopy(layer)
    x = torch.randn(24, H)
    dy = torch.randn(24, H)
    outs = []
    for m, off in ((twin, None), (layer, gmoe.offload_activations(layer, keep_last=False))):
        xi = x.clone().requires_grad_()
        if off is not None:
            with off:
                y = m(xi)
        else:
            y = m(xi)
        y.backward(dy)
        outs.append([y.detach(), xi.grad] + [q.grad for q in m.parameters() if q.grad is not None])
        if off is not None:
            assert off.stats.tensors_offloaded > 0
    _assert_bitwise(outs[0], outs[1])


@needs_cuda
@pytest.mark.parametrize("recipe", [None, "fp8_tensorwise", "fp8_blockwise", "mxfp8"])
def test_cuda_bitwise_equal(recipe):
    model, twin, x, dy, probs = _pair(device="cuda", dtype=torch.bfloat16)
    counts = _counts("cuda")
    ctx = (lambda: gmoe.fp8_autocast(recipe)) if recipe else contextlib.nullcontext
    with ctx():
        base = _step(twin, x, counts, dy, probs)
    off = gmoe.offload_activations(model)
    with ctx():
        got = _step(model, x, counts, dy, probs, offload=off)
    torch.cuda.synchronize()
    _assert_bitwise(base, got)
    assert off.stats.tensors_offloaded > 0


@needs_cuda
def test_cuda_device_memory_released():
    model, twin, x, dy, probs = _pair(device="cuda", dtype=torch.bfloat16, layers=4)
    counts = _counts("cuda")

    def held_after_forward(off):
        xi = x.detach().clone().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        if off is None:
            y = model(xi, counts, probs)
        else:
            with off:
                y = model(xi, counts, probs)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        y.backward(dy)
        torch.cuda.synchronize()
        return held

    plain = held_after_forward(None)
    off = gmoe.offload_activations(model)
    with_off = held_after_forward(off)
    # Offloaded tensors the caller still holds (x, m_splits, probs: saved by several ops) free nothing;
    # the layers' own intermediates are most of the bytes.
    assert off.stats.bytes_offloaded > 0
    assert plain - with_off >= 0.5 * off.stats.bytes_offloaded, (plain, with_off, off.stats)

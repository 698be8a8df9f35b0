"""gmoe's package on CUDA tensors (skipped without a Hopper GPU or without the extension's CUDA
dispatch): values against the CPU backend, opcheck, a training step captured once in a CUDA graph
and replayed under three routings bitwise equal to eager, no host sync, bad input."""
import copy

import pytest
import torch

import gmoe
import reference as ref


def _cuda_ready():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("gmoe::grouped_gemm_fprop", "CUDA")


pytestmark = pytest.mark.skipif(not _cuda_ready(), reason="needs a Hopper GPU and gmoe built with CUDA")

E, H, FFN, CAP = 8, 256, 128, 1024
ROUTES = {
    "uniform": [CAP // E] * E,
    "empty_experts": [300, 0, 0, 212, 0, 400, 0, 100],
    "one_expert": [0, 0, 0, CAP - 24, 0, 0, 0, 0],  # and 24 rows past the total
}


def cuda_counts(name):
    return torch.tensor(ROUTES[name], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("activation", gmoe.ACTIVATIONS)
def test_mlp_matches_cpu_backend(route, activation):
    torch.manual_seed(0)
    m = gmoe.GroupedMLP(E, H, FFN, activation=activation, bias=True, dtype=torch.bfloat16)
    m_cuda = copy.deepcopy(m).cuda()
    counts = torch.tensor(ROUTES[route], dtype=torch.int32)
    x = torch.randn(CAP, H, dtype=torch.bfloat16)
    probs = torch.rand(CAP)
    y_cpu = m(x, counts, probs)
    y = m_cuda(x.cuda(), counts.cuda(), probs.cuda())
    # both backends round bf16 the same way up to the GEMMs' summation order
    torch.testing.assert_close(y.cpu().float(), y_cpu.float(), rtol=2e-2, atol=2e-2)
    assert torch.all(y[sum(ROUTES[route]):] == 0)


@pytest.mark.parametrize("recipe", [None, "fp8_blockwise", "fp8_tensorwise", "mxfp8"])
def test_mlp_recompute_activation_bitwise_cuda(recipe):
    """recompute_activation (z made again in backward, on the backward's stream) against the kept z."""
    torch.manual_seed(2)
    m = gmoe.GroupedMLP(E, H, FFN, activation="swiglu", bias=True, recipe=recipe, device="cuda",
                        dtype=torch.bfloat16)
    r = copy.deepcopy(m)
    r.recompute_activation = True
    counts = cuda_counts("empty_experts")
    x = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(CAP, device="cuda", requires_grad=True)
    dy = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16)
    results = []
    for mlp in (m, r):
        y = mlp(x, counts, probs)
        results.append([y, *torch.autograd.grad(y, [x, probs] + list(mlp.parameters()), dy)])
    for i, (g, w) in enumerate(zip(results[1], results[0])):
        assert torch.equal(g, w), i


def test_opcheck_cuda():
    counts = cuda_counts("empty_experts")
    x = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, 2 * FFN, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(CAP, 2 * FFN, device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.gmoe
    torch.library.opcheck(ops.grouped_gemm_fprop, (x, [w], counts, []))
    torch.library.opcheck(ops.grouped_gemm_dgrad, (dy, [w], counts))
    torch.library.opcheck(ops.grouped_gemm_wgrad, (dy, x, counts), {"out_dtype": torch.float32})
    torch.library.opcheck(ops.grouped_gemm_wgrad_, (dy, x, counts, [torch.zeros(E, 2 * FFN, H, device="cuda")]),
                          {"accumulate": True})
    torch.library.opcheck(ops.grouped_bias_grad, (dy, counts))
    torch.library.opcheck(ops.grouped_activation_forward, (dy, counts, "swiglu", torch.rand(CAP, device="cuda")))
    torch.library.opcheck(ops.fc1_glu_convert, (w, 0, 8))


def _model():
    torch.manual_seed(1)
    m = gmoe.GroupedMLP(E, H, FFN, activation="swiglu", glu_layout="interleaved:8", bias=True,
                        delay_wgrad_compute=True, device="cuda", dtype=torch.bfloat16)
    for p in m.parameters():
        p.main_grad = torch.zeros(p.shape, device="cuda")
    return m


def _step(m, x, counts, probs, dy):
    """forward, backward (dx, dprobs, dbias), backward_dw (into main_grad), an SGD step."""
    y = m(x, counts, probs)
    y.backward(dy)
    m.backward_dw()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(p.main_grad.to(p.dtype), alpha=-1e-2)
            p.main_grad.zero_()
    return y


def _snapshot(m):
    return [(p.detach().clone(), p.main_grad.clone()) for p in m.parameters()]


def _restore(m, snap):
    with torch.no_grad():
        for p, (v, g) in zip(m.parameters(), snap):
            p.copy_(v)
            p.main_grad.copy_(g)


def test_training_step_cuda_graph_replays_bitwise_under_any_routing():
    m = _model()
    snap = _snapshot(m)
    x = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(CAP, device="cuda", requires_grad=True)
    dy = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16)
    counts = cuda_counts("uniform")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph asks
        for _ in range(2):
            _step(m, x, counts, probs, dy)
    torch.cuda.current_stream().wait_stream(side)
    _restore(m, snap)
    x.grad = probs.grad = None

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # global capture mode: any sync inside fails the capture
        y_static = _step(m, x, counts, probs, dy)

    for route in ROUTES:
        new_x = torch.randn_like(x)
        new_p = torch.rand_like(probs)
        new_dy = torch.randn_like(dy)
        _restore(m, snap)
        with torch.no_grad():
            x.copy_(new_x)
            probs.copy_(new_p)
            dy.copy_(new_dy)
            counts.copy_(cuda_counts(route))
        graph.replay()
        replay = [y_static.clone(), x.grad.clone(), probs.grad.clone()] + [p.detach().clone() for p in m.parameters()]

        _restore(m, snap)
        xe = new_x.clone().requires_grad_()
        pe = new_p.clone().requires_grad_()
        counts_e = cuda_counts(route)  # made before: a copy from pageable host memory synchronises
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ye = _step(m, xe, counts_e, pe, new_dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        eager = [ye, xe.grad, pe.grad] + [p.detach() for p in m.parameters()]
        for i, (a, b) in enumerate(zip(replay, eager)):
            assert torch.equal(a, b), f"{route}: output {i} differs between the replayed graph and eager"


def test_cuda_bad_input():
    x = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, FFN, H, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="counts"):
        gmoe.grouped_gemm(x, w, torch.tensor(ROUTES["uniform"], dtype=torch.int32))  # counts on the CPU
    with pytest.raises(ValueError):
        gmoe.grouped_gemm(x, w.cpu(), cuda_counts("uniform"))  # weights on the CPU
    with pytest.raises(ValueError, match="dtype|f32"):
        gmoe.grouped_gemm(x.float(), w.float(), cuda_counts("uniform"))  # no f32 GEMM on CUDA
    with pytest.raises(ValueError):
        gmoe.grouped_gemm(torch.randn(H, CAP, device="cuda", dtype=torch.bfloat16).T, w, cuda_counts("uniform"))


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8"])
def test_fp8_quantization_bitwise_cpu_and_cuda(recipe):
    counts = torch.tensor(ROUTES["empty_experts"], dtype=torch.int32)
    x = torch.randn(CAP, H, dtype=torch.bfloat16)
    cpu = gmoe.quantize_grouped(x, counts, recipe, rowwise=True, columnwise=True)
    gpu = gmoe.quantize_grouped(x.cuda(), counts.cuda(), recipe, rowwise=True, columnwise=True)
    for name, a, b in zip(cpu._fields[:5], cpu[:5], gpu[:5]):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           (b.view(torch.uint8) if b.element_size() == 1 else b).cpu()), name


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_fp8_gemm_cuda_close_to_cpu_reference(recipe):
    counts = cuda_counts("empty_experts")
    x = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, 2 * FFN, H, device="cuda", dtype=torch.bfloat16)
    xq = gmoe.quantize_grouped(x, counts, recipe)
    wq = gmoe.quantize_weights(w, recipe)
    y = gmoe.fp8_grouped_gemm(xq, wq, counts)
    cpu = lambda q: type(q)(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in q])  # noqa: E731
    y_ref = gmoe.fp8_grouped_gemm(cpu(xq), cpu(wq), counts.cpu())
    torch.testing.assert_close(y.float().cpu(), y_ref, rtol=2e-2, atol=2e-1)


def test_device_errors_reported():
    x = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, FFN, H, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([CAP, CAP, 0, 0, 0, 0, 0, -1], dtype=torch.int32, device="cuda")
    y = gmoe.grouped_gemm(x, w, counts)  # clamped on the device, recorded in the error word
    assert y.shape == (CAP, FFN)
    with pytest.raises(ValueError, match="count"):
        gmoe.check_device_errors()
    gmoe.check_device_errors()  # read and cleared


@pytest.mark.parametrize("as_list", [True, False])
def test_host_counts_uploaded_once_bitwise(as_list):
    """m_splits given on the host (a list, or a CPU tensor) for CUDA layers: uploaded from pinned
    memory without a sync, bitwise the layer with the same counts on the device, values and
    gradients."""
    torch.manual_seed(4)
    counts = cuda_counts("empty_experts")
    host = ROUTES["empty_experts"] if as_list else counts.cpu()
    m = gmoe.GroupedMLP(E, H, FFN, bias=True, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(CAP, H, device="cuda", dtype=torch.bfloat16)
    y_dev = m(x, counts)
    y_host = m(x, host)
    torch.testing.assert_close(y_host, y_dev, rtol=0, atol=0)
    inputs = [x] + list(m.parameters())
    for g, r in zip(torch.autograd.grad(y_host, inputs, dy), torch.autograd.grad(y_dev, inputs, dy)):
        torch.testing.assert_close(g, r, rtol=0, atol=0)

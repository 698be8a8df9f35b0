"""Expert parallelism of the package on the GPUs of one host (NCCL backend): one process per GPU
(torch.multiprocessing, a NCCL process group; NVLink multicast off). Skipped with fewer than 2 GPUs
or an extension without the NCCL backend. Written for any number of GPUs (all of them are used).

* dispatch / combine: the receive layout against the header's formula on the gathered inputs, the
  scalars, combine(dispatch(x)) == x, bitwise; uniform routing, and skewed: every row to rank 0's
  experts (rank 0 receives everything, the others nothing).
* MoELayer with an EP group against the single-GPU layer (EP = 1) on the same global batch: out, dx,
  the experts' and the router's gradients (the tolerance rule of bf16; the bitwise equality of out
  and dx is reported), uniform and skewed.
* experts_wgrad_during_combine (the dispatch's backward on a communication stream beside the
  experts' delayed weight gradients): every gradient bitwise the plain backward's, the experts'
  weight gradients done by backward, no host sync; uniform and skewed; and in the graph test.
* no host sync in forward + backward (torch.cuda.set_sync_debug_mode("error")), and the layer's
  forward + backward captured once in a CUDA graph and replayed under changing routing, equal to
  eager calls bitwise.
"""
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gmoe


def why_not():
    """Why these tests cannot run here, or None."""
    if torch.cuda.device_count() < 2:
        return f"needs 2 GPUs, found {torch.cuda.device_count()}"
    try:
        torch.ops.gmoe.ep_unique_id()
    except (AttributeError, ValueError, RuntimeError) as e:  # an older extension, or no NCCL backend
        return f"the extension has no NCCL backend: {type(e).__name__}: {e}"
    return None


pytestmark = pytest.mark.skipif(why_not() is not None, reason=str(why_not()))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TIMEOUT_S = 180


def spawn(fn, *args):
    """fn(rank, world, *args) in one process per GPU; fails (and ends them) on a rank's exception or
    when they have not all finished after TIMEOUT_S (a collective that hangs)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    world = torch.cuda.device_count()
    ctx = mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.time() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"the ranks did not finish in {TIMEOUT_S} s: a collective hangs")


def _entry(rank, world, port, fn, args):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def all_gather(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


# ---- dispatch / combine -------------------------------------------------------------------------

def _dispatch_worker(rank, world, skewed):
    E, H, max_rows = 4 * world, 96, 300
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    n = max_rows - 7 * rank  # a few rows past the total on all but rank 0
    if skewed:  # every row to rank 0's experts
        ids = torch.randint(0, E // world, (n,), generator=g, device="cuda")
    else:
        ids = torch.randint(0, E, (n,), generator=g, device="cuda")
    counts = torch.bincount(ids, minlength=E).int()
    rows = torch.randn(max_rows, H, generator=g, device="cuda").bfloat16()
    rows[n:] = 0
    scalars = torch.randn(max_rows, generator=g, device="cuda")
    scalars[n:] = 0
    group = gmoe.EpGroup.from_process_group(num_experts=E, hidden=H, max_rows=max_rows)
    plan = gmoe.ep_plan(group, counts)
    recv = gmoe.ep_dispatch(group, plan, rows, scalars)
    back = gmoe.ep_combine(group, plan, recv.rows, recv.scalars)
    torch.cuda.synchronize()
    gmoe.check_device_errors()

    all_counts, all_rows, all_scalars = all_gather(counts), all_gather(rows), all_gather(scalars)
    assert torch.equal(plan.counts_all, torch.stack(all_counts))
    El = E // world
    want, want_s = [], []
    for e in range(El):
        ge = rank * El + e
        for s in range(world):
            start = int(all_counts[s][:ge].sum())
            c = int(all_counts[s][ge])
            want.append(all_rows[s][start:start + c])
            want_s.append(all_scalars[s][start:start + c])
    want, want_s = torch.cat(want), torch.cat(want_s)
    total = want.shape[0]
    assert plan.local_counts.tolist() == [int(sum(c[rank * El + e] for c in all_counts)) for e in range(El)]
    assert recv.rows.shape == (group.recv_capacity, H)
    assert torch.equal(recv.rows[:total], want) and not recv.rows[total:].any()
    assert torch.equal(recv.scalars[:total], want_s) and not recv.scalars[total:].any()
    assert torch.equal(back.rows, rows) and torch.equal(back.scalars, scalars)
    if skewed and rank > 0:
        assert total == 0
    del plan, recv, back
    torch.cuda.synchronize()
    group.close()


@pytest.mark.parametrize("skewed", [False, True])
def test_dispatch_and_combine(skewed):
    spawn(_dispatch_worker, skewed)


# ---- the layer ----------------------------------------------------------------------------------

def _layers(rank, world, E, H, F, k, T, skewed):
    """(the single-GPU layer with every expert, this rank's EP layer sharing its weights, the EP
    group, the global x, dout): every rank makes the same reference layer and global batch."""
    torch.manual_seed(0)
    kw = dict(normalize_topk=True, device="cuda", dtype=torch.bfloat16)
    ref = gmoe.MoELayer(E, H, F, k, **kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(world * T, H, device="cuda").bfloat16()
    dout = torch.randn(world * T, H, device="cuda").bfloat16()
    if skewed:  # only rank 0's experts are chosen: rank 0 receives every row, the others none
        x[:, 0] = 1.0
        with torch.no_grad():
            ref.router.weight[E // world:, 0] = -60.0
    group = gmoe.EpGroup.from_process_group(num_experts=E, hidden=H, max_rows=T * k)
    m = gmoe.MoELayer(E, H, F, k, ep_group=group, **kw)
    El = E // world
    with torch.no_grad():
        m.router.weight.copy_(ref.router.weight)
        m.experts.fc1.weight.copy_(ref.experts.fc1.weight[rank * El:(rank + 1) * El])
        m.experts.fc2.weight.copy_(ref.experts.fc2.weight[rank * El:(rank + 1) * El])
    return ref, m, group, x, dout


def _close(a, b, what):
    a, b = a.float(), b.float()
    err = ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
    assert err < 1e-2, f"{what}: relative Frobenius error {err:.3g}"
    return torch.equal(a, b)


def _layer_worker(rank, world, skewed):
    E, H, F, k, T = 8 * world, 256, 128, 4, 200
    ref, m, group, x, dout = _layers(rank, world, E, H, F, k, T, skewed)
    xr = x.clone().requires_grad_()
    out_ref = ref(xr)
    out_ref.backward(dout)
    mine = slice(rank * T, (rank + 1) * T)
    xi = x[mine].clone().requires_grad_()
    out = m(xi)
    out.backward(dout[mine])
    torch.cuda.synchronize()
    gmoe.check_device_errors()
    bitwise = {"out": _close(out, out_ref[mine], "out"), "dx": _close(xi.grad, xr.grad[mine], "dx")}
    El = E // world
    for name in ("fc1", "fc2"):
        got = getattr(m.experts, name).weight.grad
        want = getattr(ref.experts, name).weight.grad[rank * El:(rank + 1) * El]
        if skewed and rank > 0:
            assert not got.any(), f"{name}: experts without rows get no gradient"
        else:
            bitwise[name] = _close(got, want, f"d{name}")
    dr = m.router.weight.grad.float()
    dist.all_reduce(dr)
    _close(dr, ref.router.weight.grad, "drouter (the ranks' sum)")
    print(f"rank {rank} {'skewed' if skewed else 'uniform'}: bitwise equal to EP = 1: {bitwise}", flush=True)
    del out, out_ref
    torch.cuda.synchronize()
    group.close()


@pytest.mark.parametrize("skewed", [False, True])
def test_the_ep_layer_is_the_single_gpu_layer(skewed):
    spawn(_layer_worker, skewed)


def _overlap_worker(rank, world, skewed):
    E, H, F, k, T = 8 * world, 256, 128, 4, 200
    _, plain, group, x, dout = _layers(rank, world, E, H, F, k, T, skewed)
    ovl = gmoe.MoELayer(E, H, F, k, ep_group=group, normalize_topk=True, device="cuda", dtype=torch.bfloat16,
                        experts_wgrad_during_combine=True)
    ovl.load_state_dict(plain.state_dict())  # this rank's El experts: loaded as they are
    mine = slice(rank * T, (rank + 1) * T)
    res = []
    for m in (plain, ovl):
        m.delay_wgrad_compute = True
        xi = x[mine].clone().requires_grad_()
        torch.cuda.set_sync_debug_mode("error" if m is ovl else "default")
        m(xi).backward(dout[mine])
        torch.cuda.set_sync_debug_mode("default")
        in_backward = m.experts.fc1.weight.grad is not None and m.experts.fc2.weight.grad is not None
        m.backward_dw()
        torch.cuda.synchronize()
        res.append((xi.grad, {n: p.grad for n, p in m.named_parameters()}, in_backward))
    gmoe.check_device_errors()
    assert torch.equal(res[1][0], res[0][0]), "dx"
    assert res[1][1].keys() == res[0][1].keys()
    for name, g in res[0][1].items():
        assert torch.equal(res[1][1][name], g), name
    assert (res[0][2], res[1][2]) == (False, True), "which backward computed the experts' weight gradients"
    assert ovl.ep_comm_stream is not None
    torch.cuda.synchronize()
    group.close()


@pytest.mark.parametrize("skewed", [False, True])
def test_experts_wgrad_during_combine_is_the_plain_backward(skewed):
    spawn(_overlap_worker, skewed)


def _graph_worker(rank, world, overlap):
    E, H, F, k, T = 8 * world, 256, 128, 4, 128
    _, m, group, x, dout = _layers(rank, world, E, H, F, k, T, False)
    if overlap:  # the comm stream forks from and joins the captured stream inside backward
        m.delay_wgrad_compute = True
        m.experts_wgrad_during_combine = True
    params = list(m.parameters())
    xs = [torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7 * i + rank))
          .bfloat16() for i in range(3)]

    def step(inp):
        out = m(inp)
        out.backward(dout[:T])
        return out

    # warm-up on a side stream (allocator pools, lazy initialisation), then no host sync
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(xs[0].clone().requires_grad_())
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()

    # Captured before any eager step on the default stream: such a step leaves the parameters'
    # AccumulateGrad nodes on the default stream, and the capture then fails.
    for p in params:
        p.grad = None
    static_x = xs[0].clone().requires_grad_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x)
    got = {}
    for i in (1, 2, 0):
        with torch.no_grad():
            static_x.copy_(xs[i])
        graph.replay()
        torch.cuda.synchronize()
        got[i] = (static_out.clone(), static_x.grad.clone(), [p.grad.clone() for p in params])
    del graph, static_out
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("error")
    step(xs[1].clone().requires_grad_())
    torch.cuda.set_sync_debug_mode("default")

    # eager references under the three routings
    for i, inp in enumerate(xs):
        for p in params:
            p.grad = None
        xi = inp.clone().requires_grad_()
        out = step(xi)
        g_out, g_dx, g_dws = got[i]
        assert torch.equal(g_out, out.detach()), f"replay {i}: out"
        assert torch.equal(g_dx, xi.grad), f"replay {i}: dx"
        for p, dw in zip(params, g_dws):
            assert torch.equal(p.grad, dw), f"replay {i}: a weight gradient"
    gmoe.check_device_errors()
    torch.cuda.synchronize()
    group.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_no_host_sync_and_graph_replay_under_changing_routing(overlap):
    spawn(_graph_worker, overlap)

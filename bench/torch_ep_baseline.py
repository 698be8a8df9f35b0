#!/usr/bin/env python3
"""bench/torch_ep_baseline.py — the expert-parallel (EP) MoE layer across the GPUs of one host: the
PyTorch composition users run today, gmoe's MoELayer with an EP group, gmoe's dispatch / combine
alone, and NCCL's own all-to-all of the same bytes, in one run (one process per GPU).

    python3 bench/torch_ep_baseline.py --json $OUT/ep.json            (every GPU of the host)
    python3 bench/report.py $OUT/ep.json --out bench/results/h100x2.json --markdown bench/results/h100x2.md

Cases (--suite, default bench/suites/ep.json, kind "ep"): T tokens PER RANK, hidden H, ffn F, E
experts, top_k k; rank r of R holds experts [r·E/R, (r+1)·E/R) (El = E/R); each rank routes its own
tokens over all E experts. The routing as torch_moe_baseline.py draws it: x's first feature is the
constant 1 and the router's first column the case's logit_bias (skewed cases), the rest of each
logit about N(0, logit_std²). The router weight is the same on every rank, x and the expert weights
differ per rank.

Rows (kind "ep"; ms: the largest over the ranks of each rank's median):
  nccl_a2a  pass all_to_all: torch.distributed.all_to_all_single with equal splits of T·k·H bf16
            elements per rank (the bytes a rank sends in the layer's dispatch); gbps = those bytes /
            time (NCCL-tests' algbw). The reference of the target: dispatch and combine >= 80%.
  torch_ep  pass forward, forward_backward: the PyTorch composition, Megatron's alltoall token
            dispatcher without DeepEP, eager (torch.compile off: the host reads the split sizes, which
            breaks the graph anyway):
              logits = x·W_rᵀ (bf16); probs, ids = topk(softmax(logits, f32), k); probs /= Σ probs
              order = argsort(ids, stable); xp = x[order // k]; counts = bincount(ids, E)
              all_to_all_single(counts) -> rows each source sends to each local expert
              splits = (counts, received counts).tolist()                    the host sync
              recv = all_to_all_single(xp, splits)          rows grouped by source, then local expert
              xr = recv[argsort(local expert of each row, stable)]          grouped by local expert
              y = _grouped_mm(swiglu(_grouped_mm(xr, W1ᵀ)), W2ᵀ)             (El local experts)
              back = all_to_all_single(y in recv's order, reversed splits)
              out = zeros(f32).index_add_(order // k, back · probs[order]).to(bf16)
            The all-to-all's backward is the all-to-all with the splits reversed.
            pass dispatch, combine: the composition's exchanges alone (dispatch: the counts'
            all-to-all, the host sync, the rows' all-to-all and the regrouping; combine: the rows
            back into received order and the reverse all-to-all); gbps as nccl_a2a's.
  gmoe_ep   pass forward, forward_backward: gmoe.MoELayer(E, H, F, k, ep_group=gmoe.EpGroup
            .from_process_group(...), normalize_topk=True, recompute_activation=True) with the same
            weights (its parameters share the composition's storage); checked against the
            composition with a float32 router, as the module computes its logits (out and dx:
            relative Frobenius error below 2e-2: "correct").
            pass dispatch, combine: gmoe.ep_dispatch / gmoe.ep_combine alone of the composition's
            xp (plan made once, before timing); gbps = T·k·H·2 bytes / time, the same bytes as
            nccl_a2a. Checked: the dispatched rows bitwise the composition's xr, and combine(dispatch
            (xp)) bitwise xp.
            When the package or its EP support is absent, the rows say so ("skipped").
FLOPs (tflops): the expert GEMMs of a rank's T·k rows (forward 2·T·k·H·2F + 2·T·k·F·H,
forward_backward 3×); peak_mib: the largest over the ranks of one forward + backward's peak memory
beyond what was allocated before it (gmoe_ep: the EP group's symmetric window, made with the group,
is not in it; it is recv_capacity·H·2 bytes, which the group holds from construction).

Method (docs/benchmarks.md): warm-up, then --warm-ms of untimed back-to-back work (the same number
of runs on every rank: collectives must pair), then the median of --iters CUDA-event timings per
rank; x rotates between two inputs per rank. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set before the processes start).

--device cpu runs the torch side with gloo on CPU processes (a smoke run of small cases such as
tests/bench/ep_suite.json: its times are not figures; gmoe's EP rows need CUDA and NCCL there).
--dry-run lists the cases without torch.
"""
import argparse
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

torch = None  # imported in the workers (not needed by --dry-run)
dist = None

ROUTING_CHECK_TOL = 2e-2


# ---- pure logic (no torch) --------------------------------------------------------------------

def load_cases(suite_path, case_filter=""):
    with open(suite_path) as f:
        suite = json.load(f)
    return [c for c in suite["cases"] if c.get("kind") == "ep" and (not case_filter or case_filter in c["name"])]


def case_problem(case, world):
    """Why the case cannot run on `world` ranks, or None."""
    if case["E"] % world:
        return f"E = {case['E']} is not a multiple of the EP size {world}"
    if not 1 <= case["top_k"] <= case["E"]:
        return f"top_k {case['top_k']} is not in 1..E = 1..{case['E']}"
    if case["tokens"] * case["top_k"] % world:
        return f"T·k = {case['tokens'] * case['top_k']} rows do not split equally over {world} ranks (nccl_a2a)"
    return None


def dispatch_bytes(case, elem_bytes=2):
    """Bytes one rank sends in the dispatch (and receives back in the combine): its T·k rows."""
    return case["tokens"] * case["top_k"] * case["hidden"] * elem_bytes


def expert_flops(case):
    """One rank's expert GEMMs in one forward: T·k rows through FC1 (2·F outputs) and FC2."""
    rows = case["tokens"] * case["top_k"]
    return 2.0 * rows * case["hidden"] * 2 * case["ffn"] + 2.0 * rows * case["ffn"] * case["hidden"]


def gbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e9


def rank_max(values):
    """The collective's time from each rank's median: the slowest rank's (None if any is missing)."""
    return None if not values or any(v is None for v in values) else max(values)


def local_expert_order(counts_from, world, local_experts):
    """Pure-Python twin of the composition's regrouping (used by the tests): for the received rows,
    grouped by source s then local expert e with counts_from[s][e] rows each, the index of the
    received row at each position of the layout grouped by local expert, then source."""
    starts, pos = {}, 0
    for s in range(world):
        for e in range(local_experts):
            starts[(s, e)] = pos
            pos += counts_from[s][e]
    return [starts[(s, e)] + j for e in range(local_experts) for s in range(world) for j in range(counts_from[s][e])]


def skipped_rows(case, world, impls_passes, reason):
    return [{"case": case["name"], "kind": "ep", "pass": p, "impl": i, "dtype": "bf16", "ms": None, "tflops": None,
             "correct": None, "ep_size": world, "skipped": reason} for i, p in impls_passes]


ALL_ROWS = [("nccl_a2a", "all_to_all"), ("torch_ep", "forward"), ("torch_ep", "forward_backward"),
            ("torch_ep", "dispatch"), ("torch_ep", "combine"),
            ("gmoe_ep", "forward"), ("gmoe_ep", "forward_backward"), ("gmoe_ep", "dispatch"), ("gmoe_ep", "combine")]
GMOE_ROWS = [r for r in ALL_ROWS if r[0] == "gmoe_ep"]


def describe(case, world):
    El = case["E"] // world if case["E"] % world == 0 else None
    problem = case_problem(case, world)
    return (f"{case['name']:26s} {case['tokens']} tokens/rank, top-{case['top_k']} of E {case['E']} "
            f"({'-' if El is None else El} per rank on {world}), hidden {case['hidden']}, ffn {case['ffn']}, "
            f"{case['routing']} routing; dispatch {dispatch_bytes(case) / 2 ** 20:.1f} MiB/rank, "
            f"{expert_flops(case) / 1e9:.0f} GFLOP/rank forward" + (f"; skipped: {problem}" if problem else ""))


# ---- the PyTorch composition --------------------------------------------------------------------

def _all_to_all_class():
    class AllToAll(torch.autograd.Function):
        """all_to_all_single with host split sizes; its backward is the reverse exchange (Megatron's
        _AllToAll)."""

        @staticmethod
        def forward(ctx, x, out_splits, in_splits, group):
            ctx.splits, ctx.group = (out_splits, in_splits), group
            out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
            return out

        @staticmethod
        def backward(ctx, dy):
            out_splits, in_splits = ctx.splits
            dx = dy.new_empty((sum(in_splits),) + tuple(dy.shape[1:]))
            dist.all_to_all_single(dx, dy.contiguous(), in_splits, out_splits, group=ctx.group)
            return dx, None, None, None

    return AllToAll


_A2A = None


def all_to_all(x, out_splits, in_splits, group=None):
    global _A2A
    if _A2A is None:
        _A2A = _all_to_all_class()
    return _A2A.apply(x, out_splits, in_splits, group)


def route(x, w_r, top_k, router_dtype=None):
    """(probs f32 [T, k] renormalised, ids [T, k]) of the softmax router."""
    rd = router_dtype or x.dtype
    logits = torch.nn.functional.linear(x.to(rd), w_r.to(rd))
    probs, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    return probs / probs.sum(dim=-1, keepdim=True), ids


def permute_by_expert(x, ids, num_experts):
    """(xp: x's rows grouped by global expert, order, counts int64 [E])."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    xp = x.index_select(0, order // ids.shape[1])
    return xp, order, torch.bincount(flat, minlength=num_experts)


def exchange_counts(counts, world, group=None):
    """(received counts [R, El]: row s = what rank s sends to each of this rank's experts, send
    splits, receive splits): the counts' all-to-all, then the split sizes read on the host."""
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(world, -1)
    splits = torch.cat([counts.view(world, -1).sum(1), recv_counts.sum(1)]).tolist()  # the host sync
    return recv_counts, splits[:world], splits[world:]


def torch_dispatch(xp, counts, world, group=None):
    """The rows of this rank's experts grouped by local expert, then source: (xr, regroup index,
    local counts [El], splits)."""
    recv_counts, send, recv_splits = exchange_counts(counts, world, group)
    recv = all_to_all(xp, recv_splits, send, group)
    El = recv_counts.shape[1]
    expert_of_row = torch.arange(El, device=xp.device).repeat(world).repeat_interleave(
        recv_counts.reshape(-1), output_size=recv.shape[0])
    regroup = torch.argsort(expert_of_row, stable=True)
    return recv.index_select(0, regroup), regroup, recv_counts.sum(0), (send, recv_splits)


def swiglu_mlp(xr, w1, w2, local_counts):
    offs = torch.cumsum(local_counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(xr, w1.transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2.transpose(-2, -1), offs=offs)


def torch_ep_layer(x, w_r, w1, w2, top_k, world, group=None, router_dtype=None):
    """The EP MoE layer composed of torch ops (see the module docstring); w1 [El, 2F, H] and w2
    [El, H, F] are this rank's experts, w_r [E, H] the whole router."""
    probs, ids = route(x, w_r, top_k, router_dtype)
    xp, order, counts = permute_by_expert(x, ids, w_r.shape[0])
    xr, regroup, local_counts, (send, recv_splits) = torch_dispatch(xp, counts, world, group)
    y = swiglu_mlp(xr, w1, w2, local_counts)
    back = all_to_all(torch.zeros_like(y).index_copy(0, regroup, y), send, recv_splits, group)
    weighted = back * probs.reshape(-1).index_select(0, order).unsqueeze(-1).to(back.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, order // top_k, weighted.float())
    return out.to(x.dtype)


# ---- inputs, timing -----------------------------------------------------------------------------

def make_inputs(case, rank, world, dev, seed=0, rotate=2):
    """([x] * rotate (this rank's tokens), w_r (the same on every rank), w1, w2 (this rank's
    experts), dout), bf16, drawn on the device."""
    T, H, F, E = case["tokens"], case["hidden"], case["ffn"], case["E"]
    El = E // world
    bias = case.get("logit_bias") or [0.0] * E
    std = case.get("logit_std", 1.0)
    dt = torch.bfloat16

    def gen(s):
        return torch.Generator(device=dev).manual_seed(s)

    def randn(g, *shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=dev, dtype=dt).mul_(scale)

    g = gen(seed)  # shared
    w_r = randn(g, E, H, scale=std / math.sqrt(max(H - 1, 1)))
    w_r[:, 0] = torch.tensor(bias, dtype=torch.float32).to(dev, dt)
    g = gen(seed + 1000 + rank)  # per rank
    xs = []
    for _ in range(rotate):
        x = randn(g, T, H)
        x[:, 0] = 1.0
        xs.append(x.requires_grad_())
    w1 = randn(g, El, 2 * F, H, scale=H ** -0.5)
    w2 = randn(g, El, H, F, scale=F ** -0.5)
    dout = randn(g, T, H)
    return xs, w_r.requires_grad_(), w1.requires_grad_(), w2.requires_grad_(), dout


def synchronize(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


class Timer:
    """The same number of runs on every rank (collectives pair up), timed per rank."""

    def __init__(self, dev, args, group=None):
        self.dev, self.args, self.group = dev, args, group

    def agreed_max(self, value):
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.item()

    def __call__(self, fn):
        """This rank's median ms of fn over --iters runs."""
        a = self.args
        dist.barrier(group=self.group)
        t0 = time.perf_counter()
        for _ in range(a.warmup):
            fn()
        synchronize(self.dev)
        per_run = (time.perf_counter() - t0) * 1e3 / max(a.warmup, 1)
        extra = 0 if self.dev != "cuda" or a.warm_ms <= 0 else int(self.agreed_max(math.ceil(a.warm_ms / max(per_run, 1e-3))))
        for _ in range(min(extra, 10000)):
            fn()
        dist.barrier(group=self.group)
        times = []
        if self.dev == "cuda":
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters)]
            for i in range(a.iters):
                starts[i].record()
                fn()
                ends[i].record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        else:
            for _ in range(a.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def gather(value, group=None):
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def relative_error(got, ref):
    got, ref = got.float(), ref.float()
    return ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def peak_mib(fn, dev):
    if dev != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20


# ---- gmoe ---------------------------------------------------------------------------------------

def gmoe_ep_parts(case, world, dev, pg, w_r, w1, w2):
    """(gmoe module, EP group, None) with the composition's weights, or (None, None, reason)."""
    try:
        import gmoe
    except Exception as e:  # noqa: BLE001 (any import failure means: not available here)
        return None, None, f"the gmoe package is not importable ({type(e).__name__}: {e})"
    if not hasattr(gmoe, "EpGroup"):
        return None, None, "the gmoe package has no EpGroup (expert parallelism)"
    E, H, F, k, T = case["E"], case["hidden"], case["ffn"], case["top_k"], case["tokens"]
    try:
        group = gmoe.EpGroup.from_process_group(pg, num_experts=E, hidden=H, max_rows=T * k, device=dev,
                                                dtype=torch.bfloat16)
        m = gmoe.MoELayer(E, H, F, k, ep_group=group, normalize_topk=True, recompute_activation=True,
                          activation=case.get("activation", "swiglu"), device=dev, dtype=torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        return None, None, f"gmoe EP layer: {type(e).__name__}: {e}"
    shapes = {"router.weight": w_r, "experts.fc1.weight": w1, "experts.fc2.weight": w2}
    params = dict(m.named_parameters())
    for name, src in shapes.items():
        p = params.get(name)
        if p is None or tuple(p.shape) != tuple(src.shape):
            return None, None, (f"gmoe.MoELayer with an EP group: parameter {name} is "
                                f"{None if p is None else tuple(p.shape)}, expected {tuple(src.shape)}")
        p.data = src.detach()  # the same storage: the same weights
    return m, group, None


# ---- one case -----------------------------------------------------------------------------------

def case_rows(case, args, dev, rank, world, pg, notes):
    problem = case_problem(case, world)
    if problem:
        return skipped_rows(case, world, ALL_ROWS, problem)
    T, k, H = case["tokens"], case["top_k"], case["hidden"]
    xs, w_r, w1, w2, dout = make_inputs(case, rank, world, dev)
    weights = [w_r, w1, w2]
    timer = Timer(dev, args, pg)
    nbytes, flops = dispatch_bytes(case), expert_flops(case)
    base = {"case": case["name"], "kind": "ep", "dtype": "bf16", "ep_size": world, "tokens_per_rank": T}
    rows = []
    it = [0]

    def next_x():
        it[0] += 1
        return xs[it[0] % len(xs)]

    def add(impl, pass_name, ms_list, correct=None, gb=None, fl=None, **extra):
        ms = rank_max(ms_list)
        r = dict(base, impl=impl, **{"pass": pass_name}, ms=ms, rank_ms=ms_list,
                 tflops=None if fl is None else fl / (ms * 1e-3) / 1e12, correct=correct)
        if gb is not None:
            r["bytes"], r["gbps"] = gb, gbps(gb, ms)
        r.update(extra)
        rows.append(r)

    # NCCL's all-to-all of the dispatch's bytes, equal splits
    src = torch.randn(T * k, H, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    add("nccl_a2a", "all_to_all", gather(timer(lambda: dist.all_to_all_single(dst, src, group=pg)), pg), gb=nbytes)
    del src, dst

    # the PyTorch composition
    def torch_fwd():
        return torch_ep_layer(next_x(), w_r, w1, w2, k, world, pg)

    def torch_fwd_bwd():
        x = next_x()
        torch.autograd.grad(torch_ep_layer(x, w_r, w1, w2, k, world, pg), [x] + weights, grad_outputs=dout)

    torch_fwd_bwd()
    synchronize(dev)
    peak = gather(peak_mib(torch_fwd_bwd, dev), pg)
    add("torch_ep", "forward", gather(timer(torch_fwd), pg), fl=flops)
    add("torch_ep", "forward_backward", gather(timer(torch_fwd_bwd), pg), fl=3 * flops, peak_mib=rank_max(peak))

    # the composition's exchanges alone: dispatch (the counts' all-to-all, the split sizes to the host,
    # the rows' all-to-all, the regrouping by local expert) and combine (the rows back in received
    # order, the reverse all-to-all), on the permuted rows of the first input
    with torch.no_grad():
        _, ids = route(xs[0], w_r, k)
        xp, _, counts = permute_by_expert(xs[0], ids, case["E"])
        xr, regroup, _, (send, recv_splits) = torch_dispatch(xp, counts, world, pg)
        add("torch_ep", "dispatch", gather(timer(lambda: torch_dispatch(xp, counts, world, pg)), pg), gb=nbytes)
        add("torch_ep", "combine", gather(timer(lambda: all_to_all(
            torch.zeros_like(xr).index_copy(0, regroup, xr), send, recv_splits, pg)), pg), gb=nbytes)

    # gmoe
    m, group, why = gmoe_ep_parts(case, world, dev, pg, w_r, w1, w2)
    whys = gather(why, pg)
    why = next((w for w in whys if w), None)
    if why:
        notes.add(f"gmoe_ep: {why}")
        rows += skipped_rows(case, world, GMOE_ROWS, why)
        return rows
    import gmoe
    params = [p for p in m.parameters() if p.requires_grad]
    x = xs[0]
    out_ref = torch_ep_layer(x, w_r, w1, w2, k, world, pg, router_dtype=torch.float32)
    (dx_ref,) = torch.autograd.grad(out_ref, [x], grad_outputs=dout)
    out = m(x)
    (dx,) = torch.autograd.grad(out, [x], grad_outputs=dout)
    errs = (relative_error(out, out_ref), relative_error(dx, dx_ref))
    all_errs = gather(errs, pg)
    ok = all(max(e) < ROUTING_CHECK_TOL for e in all_errs)
    note = "relative Frobenius error against the composition (float32 router), worst rank: out {:.3g}, dx {:.3g}".format(
        max(e[0] for e in all_errs), max(e[1] for e in all_errs))
    del out, out_ref, dx, dx_ref

    def gmoe_fwd():
        return m(next_x())

    def gmoe_fwd_bwd():
        xx = next_x()
        torch.autograd.grad(m(xx), [xx] + params, grad_outputs=dout)

    gmoe_fwd_bwd()
    synchronize(dev)
    peak = gather(peak_mib(gmoe_fwd_bwd, dev), pg)
    add("gmoe_ep", "forward", gather(timer(gmoe_fwd), pg), correct=ok, fl=flops, note=note)
    add("gmoe_ep", "forward_backward", gather(timer(gmoe_fwd_bwd), pg), correct=ok, fl=3 * flops,
        peak_mib=rank_max(peak), note=note)

    # dispatch and combine alone, on the composition's permuted rows
    with torch.no_grad():
        plan = gmoe.ep_plan(group, counts.to(torch.int32))
        recv = gmoe.ep_dispatch(group, plan, xp).rows
        back = gmoe.ep_combine(group, plan, recv).rows
        n = xr.shape[0]
        same = (torch.equal(recv[:n], xr) and bool((recv[n:] == 0).all()) and torch.equal(back[:xp.shape[0]], xp))
        ok = all(gather(same, pg))
        add("gmoe_ep", "dispatch", gather(timer(lambda: gmoe.ep_dispatch(group, plan, xp)), pg), correct=ok, gb=nbytes,
            note="dispatched rows bitwise the composition's; combine(dispatch(xp)) bitwise xp")
        add("gmoe_ep", "combine", gather(timer(lambda: gmoe.ep_combine(group, plan, recv)), pg), correct=ok, gb=nbytes)
    del m, plan, recv, back, xp, xr
    synchronize(dev)
    group.close()  # collective: every rank here
    return rows


# ---- processes ----------------------------------------------------------------------------------

def commit_of():
    c = os.environ.get("GMOE_COMMIT")
    if c:
        return c
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def worker(rank, world, args, port, cases):
    global torch, dist
    import torch as torch_module
    import torch.distributed as dist_module
    torch, dist = torch_module, dist_module
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dev = args.device
    kw = {}
    if dev == "cuda":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout), **kw)
    pg = dist.group.WORLD
    rows, errors, notes = [], [], set()
    notes.add("torch_ep: eager (torch.compile off): the host reads the all-to-all's split sizes")
    for case in cases:
        t0 = time.time()
        try:
            rows += case_rows(case, args, dev, rank, world, pg, notes)
        except Exception as e:  # recorded; the other ranks fail the same way or time out
            msg = f"{type(e).__name__}: {e}"
            print(f"rank {rank} {case['name']}: {msg}", file=sys.stderr, flush=True)
            errors.append({"case": case["name"], "impl": "torch_ep_baseline", "error": f"rank {rank}: {msg}"[:2000]})
            if dev == "cuda":
                torch.cuda.synchronize()
        if dev == "cuda":
            torch.cuda.empty_cache()
        # after every case: what is done survives a later case that hangs
        all_errors, all_notes = gather(errors, pg), gather(sorted(notes), pg)
        if rank == 0:
            write_result(args, dev, world, rows, all_errors, all_notes)
            print(f"torch ep: {case['name']} done ({time.time() - t0:.1f} s)", flush=True)
    if rank == 0:
        print(summary(rows))
    dist.destroy_process_group()


def write_result(args, dev, world, rows, all_errors, all_notes):
    result = {"gpu": (torch.cuda.get_device_name(0) + f" x{world}") if dev == "cuda" else f"cpu x{world}",
              "commit": commit_of(), "suite": os.path.basename(args.suite).split(".")[0],
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "ep_size": world,
              "rows": rows, "errors": [e for es in all_errors for e in es],
              "notes": sorted({n for ns in all_notes for n in ns})}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


def summary(rows):
    by = {(r["case"], r["impl"], r["pass"]): r for r in rows}
    fmt = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = ["| case | nccl_a2a GB/s | dispatch GB/s | combine GB/s | torch_ep fwd+bwd ms | gmoe_ep fwd+bwd ms | "
             "torch_ep/gmoe_ep |", "|---|" + "---:|" * 6]
    for case in dict.fromkeys(r["case"] for r in rows):
        get = lambda i, p, key: (by.get((case, i, p)) or {}).get(key)  # noqa: E731
        t, g = get("torch_ep", "forward_backward", "ms"), get("gmoe_ep", "forward_backward", "ms")
        lines.append(f"| {case} | {fmt(get('nccl_a2a', 'all_to_all', 'gbps'), 0)} | "
                     f"{fmt(get('gmoe_ep', 'dispatch', 'gbps'), 0)} | {fmt(get('gmoe_ep', 'combine', 'gbps'), 0)} | "
                     f"{fmt(t)} | {fmt(g)} | {'-' if t is None or g is None else f'{t / g:.2f}x'} |")
    return "\n".join(lines)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "suites", "ep.json"))
    ap.add_argument("--json", help="output file (required unless --dry-run)")
    ap.add_argument("--case", default="", help="only cases whose name contains this")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cuda: one process per GPU, NCCL; cpu: gloo processes (a smoke run of the torch side)")
    ap.add_argument("--world", type=int, default=0,
                    help="processes (the EP size); 0: every GPU (cuda) or 2 (cpu)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--warm-ms", type=float, default=500.0,
                    help="CUDA: ms of back-to-back untimed work before each timing")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=180.0,
                    help="seconds a torch.distributed collective may wait for the other ranks (a rank that failed "
                         "alone makes the others time out instead of hang)")
    ap.add_argument("--max-seconds", type=float, default=540.0,
                    help="the whole run's limit: past it the processes are ended (the cases done are written)")
    ap.add_argument("--dry-run", action="store_true", help="print the cases, then exit")
    args = ap.parse_args()
    if args.iters < 1 or args.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    if args.world < 0 or args.world == 1:
        ap.error("--world must be 0 (all GPUs) or >= 2")
    if not args.dry_run and not args.json:
        ap.error("--json is required (unless --dry-run)")
    cases = load_cases(args.suite, args.case)
    if args.dry_run:
        world = args.world or 2
        for c in cases:
            print(describe(c, world))
        print(f"{len(cases)} cases on {world} ranks")
        return 0
    # NVLink multicast stays off (NCCL's NVLS, symmetric memory's multicast): set before any process
    # initialises NCCL.
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    import torch.multiprocessing as mp
    if args.world:
        world = args.world
    elif args.device == "cuda":
        import torch as torch_module
        world = torch_module.cuda.device_count()
        if world < 2:
            print(f"torch_ep_baseline: needs at least 2 GPUs, found {world}", file=sys.stderr)
            return 2
    else:
        world = 2
    ctx = mp.start_processes(worker, args=(world, args, free_port(), cases), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.time() + args.max_seconds
    while not ctx.join(timeout=5):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            print(f"torch_ep_baseline: not done after {args.max_seconds:.0f} s (a collective hangs?); the cases "
                  f"finished so far are in {args.json}", file=sys.stderr)
            return 3
    with open(args.json) as f:
        rows = json.load(f)["rows"]
    return 1 if any(r.get("correct") is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

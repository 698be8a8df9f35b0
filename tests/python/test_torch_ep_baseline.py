"""bench/torch_ep_baseline.py on the CPU: the expert-parallel PyTorch composition it times, run by 2
gloo processes, against the single-process MoE block of torch_moe_baseline.py on the global batch
(forward and every gradient), including a routing where one rank receives no row; and a smoke run
of the script on tests/bench/ep_suite.json (its gmoe rows measured when the package has expert
parallelism, else skipped rows that say why)."""
import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gmoe

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "bench", "torch_ep_baseline.py")
MOE_SCRIPT = os.path.join(ROOT, "bench", "torch_moe_baseline.py")
SUITE = os.path.join(ROOT, "tests", "bench", "ep_suite.json")


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    m.torch = torch
    return m


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def composition_worker(rank, world, port, inputs, out_dir):
    teb = load(SCRIPT, "torch_ep_baseline")
    teb.dist = dist
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x_all, w_r, w1_all, w2_all, dout_all, k = inputs
    T, El = x_all.shape[0] // world, w1_all.shape[0] // world
    x = x_all[rank * T:(rank + 1) * T].clone().requires_grad_()
    w_r = w_r.clone().requires_grad_()
    w1 = w1_all[rank * El:(rank + 1) * El].clone().requires_grad_()
    w2 = w2_all[rank * El:(rank + 1) * El].clone().requires_grad_()
    out = teb.torch_ep_layer(x, w_r, w1, w2, k, world)
    grads = torch.autograd.grad(out, [x, w_r, w1, w2], grad_outputs=dout_all[rank * T:(rank + 1) * T])
    torch.save([out.detach()] + list(grads), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("world,routing", [(2, "uniform"), (3, "uniform"), (2, "first_rank_gets_all")])
def test_the_composition_is_the_moe_block_on_the_global_batch(tmp_path, world, routing):
    torch.manual_seed(world)
    T, H, F, El, k = 13, 32, 16, 3, 2
    E = El * world
    x = torch.randn(world * T, H, dtype=torch.bfloat16)
    w_r = torch.randn(E, H, dtype=torch.bfloat16)
    if routing == "first_rank_gets_all":  # only rank 0's experts are ever chosen: the others receive nothing
        x[:, 0] = 1.0
        w_r[:, 0] = torch.tensor([0.0] * El + [-30.0] * (E - El))
    w1 = torch.randn(E, 2 * F, H, dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(E, H, F, dtype=torch.bfloat16) * F ** -0.5
    dout = torch.randn(world * T, H, dtype=torch.bfloat16)
    mp.spawn(composition_worker, args=(world, free_port(), (x, w_r, w1, w2, dout, k), str(tmp_path)), nprocs=world)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    out = torch.cat([g[0] for g in got])
    dx = torch.cat([g[1] for g in got])
    dw_r = sum(g[2].float() for g in got)  # the router is replicated: its gradient is the ranks' sum
    dw1, dw2 = torch.cat([g[3] for g in got]), torch.cat([g[4] for g in got])

    tmb = load(MOE_SCRIPT, "torch_moe_baseline")
    leaves = [t.clone().requires_grad_() for t in (x, w_r, w1, w2)]
    ref = tmb.moe_block(*leaves, k, "swiglu")
    ref_grads = torch.autograd.grad(ref, leaves, grad_outputs=dout)
    for name, a, b in (("out", out, ref), ("dx", dx, ref_grads[0]), ("dw_r", dw_r, ref_grads[1]),
                       ("dw1", dw1, ref_grads[2]), ("dw2", dw2, ref_grads[3])):
        if name in ("dw1", "dw2") and routing == "first_rank_gets_all":
            assert a[El:].abs().max().item() == 0, name  # experts without rows get no gradient
            a, b = a[:El], b[:El]
        assert rel(a, b) < 1e-2, (name, rel(a, b))


def test_the_regrouping_twin():
    teb = load(SCRIPT, "torch_ep_baseline")
    # 2 sources, 2 local experts: received [s0e0: 2 rows, s0e1: 1, s1e0: 0, s1e1: 3]
    assert teb.local_expert_order([[2, 1], [0, 3]], 2, 2) == [0, 1, 2, 3, 4, 5]
    assert teb.local_expert_order([[1, 1], [1, 1]], 2, 2) == [0, 2, 1, 3]
    assert teb.local_expert_order([[0, 2], [2, 0]], 2, 2) == [2, 3, 0, 1]


def test_the_script_runs_on_cpu_processes(tmp_path):
    out = tmp_path / "ep.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(gmoe.__file__)), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, SCRIPT, "--suite", SUITE, "--device", "cpu", "--iters", "2", "--warmup", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(out.read_text())
    assert result["ep_size"] == 2 and not result["errors"], result["errors"]
    rows = {(r["case"], r["impl"], r["pass"]): r for r in result["rows"]}
    for name in ("tiny/uniform", "tiny/skewed", "one_rank_gets_all/skewed"):
        a2a = rows[(name, "nccl_a2a", "all_to_all")]
        assert a2a["kind"] == "ep" and a2a["ms"] > 0 and a2a["gbps"] > 0 and len(a2a["rank_ms"]) == 2
        for pass_name in ("forward", "forward_backward", "dispatch", "combine"):
            r = rows[(name, "torch_ep", pass_name)]
            assert r["ms"] > 0 and r["ms"] == max(r["rank_ms"]), r
        assert rows[(name, "torch_ep", "dispatch")]["bytes"] == a2a["bytes"]  # the same bytes as nccl_a2a's
        for pass_name in ("forward", "forward_backward", "dispatch", "combine"):
            r = rows[(name, "gmoe_ep", pass_name)]
            assert r.get("skipped") or r["correct"] is True, r
    for impl, pass_name in (("nccl_a2a", "all_to_all"), ("torch_ep", "forward"), ("gmoe_ep", "dispatch")):
        assert "not a multiple of the EP size 2" in rows[("odd_e/uniform", impl, pass_name)]["skipped"]
    assert "torch_ep/gmoe_ep" in p.stdout  # the summary table

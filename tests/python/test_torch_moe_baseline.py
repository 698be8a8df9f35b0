"""bench/torch_moe_baseline.py on the CPU: the PyTorch MoE block it times against a per-token dense
reference, its count of saved bytes, and a smoke run of the script on the small moe cases of
tests/bench/moe_suite.json (eager only: compiling takes minutes on a CI machine), with gmoe.MoELayer
timed beside it when the package has it."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import gmoe

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(ROOT, "bench", "torch_moe_baseline.py")
SUITE = os.path.join(ROOT, "tests", "bench", "moe_suite.json")


@pytest.fixture(scope="module")
def tmb():
    spec = importlib.util.spec_from_file_location("torch_moe_baseline", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    m.torch = torch
    return m


@pytest.mark.parametrize("act", ["swiglu", "clamped_swiglu"])
def test_the_block_is_the_moe_block(tmb, act):
    torch.manual_seed(0)
    T, H, F, E, k = 37, 32, 16, 6, 3
    x = torch.randn(T, H, dtype=torch.bfloat16)
    w_r = torch.randn(E, H, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * F, H, dtype=torch.bfloat16) * H ** -0.5
    w2 = torch.randn(E, H, F, dtype=torch.bfloat16) * F ** -0.5
    w_r[:, 0] = torch.tensor([0.0, -0.5, -1.0, -1.5, -2.0, -30.0])  # expert 5 never chosen
    out = tmb.moe_block(x, w_r, w1, w2, k, act)
    # per token, densely, in f32 (the top-k of the bf16 logits, softmax over the chosen k)
    logits = torch.nn.functional.linear(x, w_r).float()
    ref = torch.zeros(T, H)
    for t in range(T):
        top = torch.topk(logits[t], k)
        p = torch.softmax(top.values, -1)
        for j, e in enumerate(top.indices.tolist()):
            h = w1[e].float() @ x[t].float()
            z = tmb.ACTIVATIONS[act](h[:F], h[F:])
            ref[t] += p[j] * (w2[e].float() @ z)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err


def test_saved_bytes_counts_each_storage_once_without_parameters(tmb):
    w = torch.randn(64, requires_grad=True)
    x = torch.randn(64, requires_grad=True)
    # x is saved three times (for w's gradient and twice by x * x), w by the first product
    assert tmb.saved_bytes(lambda: (w * x).sum() + (x * x).sum(), [w]) == 64 * 4
    assert tmb.saved_bytes(lambda: (w * x).sum(), []) == 2 * 64 * 4


def test_the_script_runs_on_the_cpu(tmp_path):
    out = tmp_path / "moe.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(gmoe.__file__)), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, SCRIPT, "--suite", SUITE, "--case", "tiny", "--device", "cpu", "--no-compile",
                        "--iters", "1", "--warmup", "0", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    result = json.loads(out.read_text())
    with open(SUITE) as f:
        cases = {c["name"]: c for c in json.load(f)["cases"] if c["name"].startswith("tiny")}
    rows = {(r["case"], r["impl"], r["pass"]): r for r in result["rows"]}
    for name, c in cases.items():
        for pass_name in ("forward", "forward_backward"):
            r = rows[(name, "torch", pass_name)]
            assert r["kind"] == "moe" and r["ms"] > 0
            # at least x and the permuted rows (top_k copies of each token), bf16
            assert r["saved_bytes_per_token"] > 2 * (c["hidden"] + c["top_k"] * c["hidden"]), r
            assert r["kept_bytes_per_token"] == r["saved_bytes_per_token"]  # the CPU has no allocator count
    if hasattr(gmoe, "MoELayer"):
        assert all((name, "gmoe_torch", "forward_backward") in rows for name in cases)
        for name, c in cases.items():
            # the module's default gathers the permuted rows again from x: top_k bf16 copies of each
            # token fewer, x itself more (without it only the router's float32 copy of x is saved)
            re, keep = rows[(name, "gmoe_torch", "forward_backward")], \
                rows[(name, "gmoe_torch_keep_input", "forward_backward")]
            assert keep["saved_bytes_per_token"] - re["saved_bytes_per_token"] == 2 * (c["top_k"] - 1) * c["hidden"]
    else:
        assert any("gmoe_torch: absent" in n for n in result["notes"])
        assert "gmoe_torch: absent" in p.stdout

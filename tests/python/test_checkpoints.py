"""Checkpoints of real model families through gmoe-ckpt, seen from Python.

Files are written here with Python's ``safetensors`` (the reference implementation, pinned and
installed by scripts/test_python.sh) with the key names of Hugging Face Mixtral, Qwen3-MoE and
gpt-oss; gmoe-ckpt (GMOE_CKPT_BIN, which scripts/test_python.sh sets) recognises and converts
them; the results are read back with ``safetensors`` and checked value by value, and loaded into
``gmoe.GroupedMLP``, whose output must match a plain-torch reference of the source model's own
experts.
"""
import os
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import gmoe

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def ckpt_bin():
    path = os.environ.get("GMOE_CKPT_BIN")
    candidates = [path] if path else [os.path.join(ROOT, "build", d, "gmoe-ckpt") for d in ("default", "cpu")]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise AssertionError(f"gmoe-ckpt not found (tried {candidates}); scripts/test_python.sh builds it and sets "
                         "GMOE_CKPT_BIN")


def run(*args, ok=True):
    r = subprocess.run([ckpt_bin(), *args], capture_output=True, text=True)
    if ok:
        assert r.returncode == 0, f"gmoe-ckpt {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def mixtral_state(E, H, F, layers=2, dtype=torch.bfloat16, scale=1.0):
    t = {}
    for L in range(layers):
        p = f"model.layers.{L}.block_sparse_moe."
        for e in range(E):
            t[f"{p}experts.{e}.w1.weight"] = (torch.randn(F, H) * scale).to(dtype)
            t[f"{p}experts.{e}.w3.weight"] = (torch.randn(F, H) * scale).to(dtype)
            t[f"{p}experts.{e}.w2.weight"] = (torch.randn(H, F) * scale).to(dtype)
        t[p + "gate.weight"] = torch.randn(E, H).to(dtype)
        t[f"model.layers.{L}.input_layernorm.weight"] = torch.randn(H).to(dtype)
    return t


def test_bf16_file_written_by_safetensors_is_read_and_converted_by_gmoe(tmp_path):
    # Mixtral-8x7B's hidden : ffn = 4096 : 14336, scaled.
    E, H, F = 8, 64, 224
    src = mixtral_state(E, H, F)
    save_file(src, tmp_path / "mixtral.safetensors", metadata={"format": "pt"})
    out = run("inspect", "--brief", str(tmp_path / "mixtral.safetensors")).stdout
    assert "convention: mixtral (Mixtral), 2 MoE layer(s), 8 experts each" in out
    assert "layer 1  model.layers.1.block_sparse_moe.  E=8 H=64 F=224  gate/up separate" in out
    assert "model.layers.0.block_sparse_moe.experts.{0..7}.w1.weight" in out

    run("convert", "--quiet", str(tmp_path / "mixtral.safetensors"), str(tmp_path / "gmoe.safetensors"), "--to", "gmoe")
    got = load_file(tmp_path / "gmoe.safetensors")
    for L in range(2):
        fc1 = got[f"model.layers.{L}.mlp.experts.fc1.weight"]
        assert fc1.dtype == torch.bfloat16 and fc1.shape == (E, 2 * F, H)
        p = f"model.layers.{L}.block_sparse_moe.experts."
        for e in range(E):
            assert torch.equal(fc1[e, :F], src[f"{p}{e}.w1.weight"])
            assert torch.equal(fc1[e, F:], src[f"{p}{e}.w3.weight"])
            assert torch.equal(got[f"model.layers.{L}.mlp.experts.fc2.weight"][e], src[f"{p}{e}.w2.weight"])
        assert torch.equal(got[f"model.layers.{L}.mlp.router.weight"], src[f"model.layers.{L}.block_sparse_moe.gate.weight"])
        assert torch.equal(got[f"model.layers.{L}.input_layernorm.weight"], src[f"model.layers.{L}.input_layernorm.weight"])
    with safe_open(tmp_path / "gmoe.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_bf16_file_written_by_gmoe_is_read_by_safetensors(tmp_path):
    # A gmoe GroupedMLP's state_dict (stacked, gate/up interleaved in blocks of 8) under a model
    # prefix, converted by gmoe-ckpt to Qwen3-MoE's per-expert keys; read with safetensors.
    E, H, F = 16, 64, 24  # Qwen3-30B-A3B: 2048 : 768
    m = gmoe.GroupedMLP(E, H, F, glu_layout="interleaved:8", dtype=torch.bfloat16)
    pre = "model.layers.0.mlp.experts."
    save_file({pre + k: v.contiguous() for k, v in m.state_dict().items()}, tmp_path / "g.safetensors")
    run("convert", "--quiet", str(tmp_path / "g.safetensors"), str(tmp_path / "q.safetensors"), "--to", "qwen",
        "--glu-from", "interleaved:8")
    with safe_open(tmp_path / "q.safetensors", "pt") as f:
        keys = set(f.keys())
        assert keys == {f"{pre}{e}.{n}.weight" for e in range(E) for n in ("gate_proj", "up_proj", "down_proj")}
        w1 = m.fc1.weight.detach()
        for e in range(E):
            gate, up = f.get_tensor(f"{pre}{e}.gate_proj.weight"), f.get_tensor(f"{pre}{e}.up_proj.weight")
            assert gate.dtype == torch.bfloat16 and gate.shape == (F, H)
            # interleaved:8: rows 16k..16k+7 gate 8k.., rows 16k+8.. up 8k..
            blocks = w1[e].view(F // 8, 2, 8, H)
            assert torch.equal(gate, blocks[:, 0].reshape(F, H))
            assert torch.equal(up, blocks[:, 1].reshape(F, H))
            assert torch.equal(f.get_tensor(f"{pre}{e}.down_proj.weight"), m.fc2.weight.detach()[e])


def mlp_from_file(path, prefix, E, H, F, **kw):
    state = {k[len(prefix):]: v for k, v in load_file(path).items() if k.startswith(prefix)}
    m = gmoe.GroupedMLP(E, H, F, dtype=torch.float32, **kw)
    m.load_state_dict(state)
    return m


def tokens(E, H, counts):
    return torch.randn(sum(counts), H), torch.tensor(counts, dtype=torch.int64)


def test_converted_mixtral_runs_in_grouped_mlp_as_mixtral_does(tmp_path):
    E, H, F = 8, 32, 112
    src = mixtral_state(E, H, F, layers=1, dtype=torch.float32, scale=0.2)
    save_file(src, tmp_path / "mixtral.safetensors")
    counts = [9, 0, 17, 1, 0, 20, 6, 8]
    x, m_splits = tokens(E, H, counts)
    # Mixtral's expert: w2(silu(w1 x) * w3 x).
    p = "model.layers.0.block_sparse_moe.experts."
    ref, row = [], 0
    for e, n in enumerate(counts):
        xe = x[row:row + n]
        row += n
        w1, w2, w3 = (src[f"{p}{e}.{k}.weight"].double() for k in ("w1", "w2", "w3"))
        ref.append((torch.nn.functional.silu(xe.double() @ w1.T) * (xe.double() @ w3.T)) @ w2.T)
    ref = torch.cat(ref)
    for glu in ("concat", "interleaved:8"):
        run("convert", "--quiet", str(tmp_path / "mixtral.safetensors"), str(tmp_path / "g.safetensors"), "--to", "gmoe",
            "--glu-to", glu)
        m = mlp_from_file(tmp_path / "g.safetensors", "model.layers.0.mlp.experts.", E, H, F,
                          glu_layout="concatenated" if glu == "concat" else glu)
        torch.testing.assert_close(m(x, m_splits).double(), ref, rtol=1e-4, atol=1e-4)


def test_converted_qwen3_runs_in_grouped_mlp_as_qwen3_does(tmp_path):
    E, H, F = 16, 48, 18  # Qwen3-30B-A3B's 2048 : 768
    p = "model.layers.0.mlp.experts."
    src = {}
    for e in range(E):
        for n, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
            src[f"{p}{e}.{n}.weight"] = torch.randn(*shape) * 0.2
    src["model.layers.0.mlp.gate.weight"] = torch.randn(E, H)
    save_file(src, tmp_path / "qwen3.safetensors")
    assert "convention: qwen (Qwen3-MoE / OLMoE)" in run("inspect", str(tmp_path / "qwen3.safetensors")).stdout
    counts = [3, 0, 0, 7, 1, 2, 9, 0, 4, 4, 1, 0, 6, 2, 2, 5]
    x, m_splits = tokens(E, H, counts)
    # Qwen3MoeMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), act_fn = silu.
    ref, row = [], 0
    for e, n in enumerate(counts):
        xe = x[row:row + n].double()
        row += n
        g, u, d = (src[f"{p}{e}.{k}.weight"].double() for k in ("gate_proj", "up_proj", "down_proj"))
        ref.append((torch.nn.functional.silu(xe @ g.T) * (xe @ u.T)) @ d.T)
    ref = torch.cat(ref)
    # Through Megatron's naming on the way, per-expert in gmoe's own layout at the end.
    run("convert", "--quiet", str(tmp_path / "qwen3.safetensors"), str(tmp_path / "m.safetensors"), "--to", "megatron")
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight15" in load_file(tmp_path / "m.safetensors")
    run("convert", "--quiet", str(tmp_path / "m.safetensors"), str(tmp_path / "g.safetensors"), "--to", "gmoe",
        "--layout", "per-expert")
    m = mlp_from_file(tmp_path / "g.safetensors", "model.layers.0.mlp.experts.", E, H, F, weight_layout="per_expert")
    torch.testing.assert_close(m(x, m_splits).double(), ref, rtol=1e-4, atol=1e-4)


def gpt_oss_state(E, H, F):
    p = "model.layers.0.mlp."
    return {p + "experts.gate_up_proj": torch.randn(E, H, 2 * F).bfloat16(),
            p + "experts.gate_up_proj_bias": torch.randn(E, 2 * F).bfloat16(),
            p + "experts.down_proj": torch.randn(E, F, H).bfloat16(),
            p + "experts.down_proj_bias": torch.randn(E, H).bfloat16(),
            p + "router.weight": torch.randn(E, H).bfloat16(),
            p + "router.bias": torch.randn(E).bfloat16()}


def test_gpt_oss_orientation_and_interleave_axis(tmp_path):
    E, H, F = 4, 48, 40
    src = gpt_oss_state(E, H, F)
    save_file(src, tmp_path / "oss.safetensors")
    out = run("inspect", str(tmp_path / "oss.safetensors")).stdout
    assert "convention: gpt-oss" in out
    assert "fc1       stacked     [in, out]  gate/up interleaved:1" in out, out
    run("convert", "--quiet", str(tmp_path / "oss.safetensors"), str(tmp_path / "g.safetensors"), "--to", "gmoe")
    got = load_file(tmp_path / "g.safetensors")
    gu = src["model.layers.0.mlp.experts.gate_up_proj"]
    fc1 = got["model.layers.0.mlp.experts.fc1.weight"]
    assert fc1.shape == (E, 2 * F, H)
    assert torch.equal(fc1[:, :F], gu[..., 0::2].transpose(1, 2))
    assert torch.equal(fc1[:, F:], gu[..., 1::2].transpose(1, 2))
    b = src["model.layers.0.mlp.experts.gate_up_proj_bias"]
    assert torch.equal(got["model.layers.0.mlp.experts.fc1.bias"], torch.cat([b[:, 0::2], b[:, 1::2]], 1))
    assert torch.equal(got["model.layers.0.mlp.experts.fc2.weight"], src["model.layers.0.mlp.experts.down_proj"].transpose(1, 2))
    assert torch.equal(got["model.layers.0.mlp.router.bias"], src["model.layers.0.mlp.router.bias"])


def test_cli_safety_and_messages(tmp_path):
    save_file(gpt_oss_state(2, 8, 8), tmp_path / "oss.safetensors")
    before = (tmp_path / "oss.safetensors").read_bytes()
    r = run("convert", str(tmp_path / "oss.safetensors"), str(tmp_path / "oss.safetensors"), ok=False)
    assert r.returncode == 1
    assert "is the input" in r.stderr and "--overwrite-input" in r.stderr
    assert ".cpp:" not in r.stderr and "check `" not in r.stderr, r.stderr
    assert (tmp_path / "oss.safetensors").read_bytes() == before
    r = run("--verbose", "convert", str(tmp_path / "oss.safetensors"), str(tmp_path / "oss.safetensors"), ok=False)
    assert ".cpp:" in r.stderr, r.stderr
    # A convention without the target's form: user words, naming what is missing.
    r = run("convert", str(tmp_path / "oss.safetensors"), str(tmp_path / "x.safetensors"), "--to", "mixtral", ok=False)
    assert r.returncode == 1 and "mixtral naming has no key for" in r.stderr and ".cpp:" not in r.stderr, r.stderr
    assert not (tmp_path / "x.safetensors").exists()
    # Dry run: the plan of keys, nothing written.
    r = run("convert", str(tmp_path / "oss.safetensors"), str(tmp_path / "m.safetensors"), "--to", "megatron", "--dry-run")
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight{0..1}" in r.stdout
    assert "model.layers.0.mlp.experts.gate_up_proj (split per expert, gate/up interleaved:1 -> gate/up concatenated, " \
           "transposed to [out, in])" in r.stdout, r.stdout
    assert not (tmp_path / "m.safetensors").exists()
    # Explicitly allowed: replaced in place through a temporary file.
    run("convert", "--quiet", str(tmp_path / "oss.safetensors"), str(tmp_path / "oss.safetensors"), "--to", "gmoe",
        "--overwrite-input")
    assert "model.layers.0.mlp.experts.fc1.weight" in load_file(tmp_path / "oss.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["oss.safetensors"]

"""examples/train_moe_lm.py on the CPU, at a size that takes seconds: the loss falls, the gmoe model
and the plain-PyTorch model agree step for step, a run stopped and resumed from its checkpoint
continues the same loss curve bit for bit, the checkpoint uses Hugging Face's expert names and
resumes the same curve after gmoe-ckpt has converted it to the other expert layout, activation
offloading leaves the curve bit for bit as it is, and what gmoe cannot do yet is refused by name."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import train_moe_lm as lm  # noqa: E402
from test_checkpoints import ckpt_bin  # noqa: E402  (GMOE_CKPT_BIN, which scripts/test_python.sh sets)

# A model small enough for CI's two cores: every test below runs in a few seconds.
TINY = ["--device", "cpu", "--layers", "1", "--hidden", "32", "--heads", "2", "--experts", "4", "--top-k", "2",
        "--ffn", "32", "--seq-len", "32", "--batch", "8", "--lr", "1e-2", "--log-every", "1000", "--out", ""]


def run(*extra, steps=10):
    return lm.main(TINY + ["--steps", str(steps)] + [str(a) for a in extra])


def test_loss_falls_and_the_two_models_agree(tmp_path):
    results = run("--out", tmp_path, steps=12)
    for impl in lm.IMPLS:
        losses = results[impl].losses
        assert len(losses) == 12
        assert losses[0] == pytest.approx(5.55, abs=0.1)  # ln(256): uniform over bytes at the start
        assert sum(losses[-3:]) / 3 < losses[0] - 0.8, f"{impl}: the loss did not fall: {losses}"
    # float32 on the CPU: the two implementations differ only in summation order (and where a
    # token's router probability is applied), far below the first-steps tolerance.
    tol_first, _ = lm.tolerances(lm.parse_args(TINY))
    g, t = results["gmoe"].losses, results["torch"].losses
    assert max(abs(a - b) for a, b in zip(g, t)) <= tol_first, (g, t)
    summary = (tmp_path / "summary.md").read_text()
    assert "the curves agree" in summary and lm.CORPUS_NAME in summary
    assert "offloading" not in summary  # only a run with --offload-activations says it offloaded
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert len(json.loads((tmp_path / "losses.json").read_text())["runs"]["gmoe"]["losses"]) == 12


@pytest.mark.parametrize("weight_layout,ckpt_layout", [("stacked", "per_expert"), ("per_expert", "stacked")])
def test_resume_continues_the_loss_curve_bitwise(tmp_path, weight_layout, ckpt_layout):
    layouts = ("--weight-layout", weight_layout, "--ckpt-layout", ckpt_layout)
    full = run(*layouts, steps=8)
    ckpt = tmp_path / "ckpt"
    first = run(*layouts, "--save-dir", ckpt, "--stop-at", 4, steps=8)
    resumed = run(*layouts, "--resume", ckpt, steps=8)
    for impl in lm.IMPLS:
        assert first[impl].losses == full[impl].losses[:4]
        assert resumed[impl].losses == full[impl].losses, impl  # the first 4 from the checkpoint, then 4 new
    state = json.loads((ckpt / "gmoe" / "trainer_state.json").read_text())
    assert state["step"] == state["data_position"] == 4
    # The same checkpoint into gmoe's other weight layout: the same curve up to rounding (the
    # gradient norm sums per tensor, and the tensors differ).
    other = "per_expert" if weight_layout == "stacked" else "stacked"
    switched = run("--weight-layout", other, "--impl", "gmoe", "--resume", ckpt, steps=8)["gmoe"].losses
    assert switched[:4] == full["gmoe"].losses[:4]
    assert switched[4:] == pytest.approx(full["gmoe"].losses[4:], abs=1e-5)


def test_checkpoint_uses_hugging_face_expert_names(tmp_path):
    from safetensors import safe_open
    run("--save-dir", tmp_path, "--ckpt-layout", "per_expert", "--impl", "gmoe", steps=2)
    with safe_open(str(tmp_path / "gmoe" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.experts.3.gate_proj.weight").get_shape() == [32, 32]
        assert f.get_slice("model.layers.0.mlp.experts.3.down_proj.weight").get_shape() == [32, 32]
        assert f.get_slice("model.layers.0.mlp.gate.weight").get_shape() == [4, 32]
    assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight",
            "model.layers.0.mlp.experts.0.up_proj.weight"} <= keys
    assert not any("fc1" in k or "router" in k for k in keys)
    with safe_open(str(tmp_path / "gmoe" / "optimizer.safetensors"), "pt") as f:
        assert "exp_avg.model.layers.0.mlp.experts.2.up_proj.weight" in set(f.keys())
    run("--save-dir", tmp_path / "stacked", "--ckpt-layout", "stacked", "--impl", "gmoe", steps=2)
    with safe_open(str(tmp_path / "stacked" / "gmoe" / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.experts.gate_proj.weight").get_shape() == [4, 32, 32]
        assert f.get_slice("model.layers.0.mlp.experts.down_proj.weight").get_shape() == [4, 32, 32]
        assert not any(".experts.0." in k for k in f.keys())


@pytest.mark.parametrize("saved,converted,activation", [("per_expert", "stacked", "swiglu"),
                                                        ("stacked", "per_expert", "squared_relu")])
def test_checkpoint_converted_by_gmoe_ckpt_resumes_the_curve_bitwise(tmp_path, saved, converted, activation):
    """gmoe-ckpt recognises the example's model and optimizer files (Qwen3-MoE's expert names; with
    squared_relu, up_proj alone as Nemotron-H names it) and rewrites them in the other expert layout
    bit for bit: the files equal what the example itself writes in that layout, and resuming from
    them continues the uninterrupted curve exactly."""
    act = ("--activation", activation)
    full = run(*act, "--ckpt-layout", saved, steps=6)
    run(*act, "--ckpt-layout", saved, "--save-dir", tmp_path / "saved", "--stop-at", 3, steps=6)
    run(*act, "--ckpt-layout", converted, "--save-dir", tmp_path / "direct", "--stop-at", 3, steps=6)
    flag = "per-expert" if converted == "per_expert" else "stacked"
    for impl in lm.IMPLS:
        (tmp_path / "conv" / impl).mkdir(parents=True)
        for name in ("model.safetensors", "optimizer.safetensors"):
            src, dst = tmp_path / "saved" / impl / name, tmp_path / "conv" / impl / name
            r = subprocess.run([ckpt_bin(), "convert", str(src), str(dst), "--layout", flag],
                               capture_output=True, text=True)
            assert r.returncode == 0, f"gmoe-ckpt convert {src}: {r.stdout}\n{r.stderr}"
            assert "qwen" in r.stdout, r.stdout  # recognised as Hugging Face (Qwen3-MoE) expert names
            got, want = load_file(str(dst)), load_file(str(tmp_path / "direct" / impl / name))
            assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
            assert all(torch.equal(got[k], want[k]) for k in want), name
        shutil.copy(tmp_path / "saved" / impl / "trainer_state.json", tmp_path / "conv" / impl)
    resumed = run(*act, "--ckpt-layout", converted, "--resume", tmp_path / "conv", steps=6)
    for impl in lm.IMPLS:
        assert resumed[impl].losses == full[impl].losses, impl


@pytest.mark.parametrize("activation", ["swiglu", "squared_relu"])
@pytest.mark.parametrize("layout", ["stacked", "per_expert"])
def test_hugging_face_names_round_trip(activation, layout):
    cfg = lm.parse_args(TINY + ["--activation", activation, "--weight-layout", "per_expert"])
    model = lm.build_model("gmoe", cfg, "cpu", torch.float32)
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    hf = lm.to_hf(state, "gmoe", cfg, layout)
    back = lm.from_hf(hf, "gmoe", cfg)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    # The gate rows of an expert's FC1 are its gate_proj (the concatenated GLU layout).
    if activation == "swiglu" and layout == "per_expert":
        assert torch.equal(hf["model.layers.0.mlp.experts.1.gate_proj.weight"],
                           state["model.layers.0.mlp.experts.fc1.weight1"][:32])
    torch_state = lm.from_hf(hf, "torch", cfg)
    lm.build_model("torch", cfg, "cpu", torch.float32).load_state_dict(torch_state)


def test_delayed_weight_gradients_give_the_same_curve():
    plain = run("--impl", "gmoe", steps=4)["gmoe"].losses
    delayed = run("--impl", "gmoe", "--delay-wgrad", steps=4)["gmoe"].losses
    assert delayed == plain


def test_fp8_recipe_trains_close_to_the_native_model():
    fp8 = run("--recipe", "fp8_blockwise", steps=6)
    g, t = fp8["gmoe"].losses, fp8["torch"].losses
    tol_first, _ = lm.tolerances(lm.parse_args(TINY + ["--recipe", "fp8_blockwise"]))
    assert max(abs(a - b) for a, b in zip(g, t)) <= tol_first, (g, t)
    assert g != t  # the experts really ran in FP8


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed_wgrad"])
def test_offloaded_activations_give_the_same_curve_bitwise(tmp_path, delayed):
    """--offload-activations moves the MoE layers' saved activations to the host and back: on the
    CPU an offload is a copy, so the losses are those of the run without it, bit for bit."""
    # Two layers: the last MoE layer's activations stay on the device, so the first is the one moved.
    extra = ("--layers", "2", "--impl", "gmoe") + (("--delay-wgrad",) if delayed else ())
    plain = run(*extra, steps=4)["gmoe"]
    off = run(*extra, "--offload-activations", "--out", tmp_path, steps=4)["gmoe"]
    assert off.losses == plain.losses
    assert plain.offloaded_bytes_per_step is None
    # The first layer's routed input, FC1 output, probabilities … of 8 x 32 tokens: at least its input.
    assert off.offloaded_bytes_per_step >= 8 * 32 * 32 * 4, off.offloaded_bytes_per_step
    summary = (tmp_path / "summary.md").read_text()
    assert "Activation offloading: **on** for the gmoe model" in summary
    assert "peak memory with it: not measured on the CPU" in summary
    assert "activations offloaded" in off.note


def test_unavailable_features_are_refused_by_name():
    with pytest.raises(SystemExit, match="--ep-size 2: expert parallelism is not available yet"):
        run("--ep-size", "2", steps=1)


def test_bfloat16_master_weights_agree_and_resume_bitwise(tmp_path):
    """bfloat16 parameters with float32 master weights (the GPU's set-up), run eagerly on the CPU."""
    bf16 = ("--dtype", "bfloat16")
    full = run(*bf16, steps=6)
    tol_first, _ = lm.tolerances(lm.parse_args(TINY + list(bf16)))
    g, t = full["gmoe"].losses, full["torch"].losses
    assert max(abs(a - b) for a, b in zip(g, t)) <= tol_first, (g, t)
    run(*bf16, "--save-dir", tmp_path, "--stop-at", 3, steps=6)
    resumed = run(*bf16, "--resume", tmp_path, steps=6)
    assert all(resumed[impl].losses == full[impl].losses for impl in lm.IMPLS)


# ---- CUDA: the captured step (skipped without a Hopper GPU and gmoe's CUDA backend) -------------

def _cuda_ready():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("gmoe::grouped_gemm_fprop", "CUDA")


cuda_only = pytest.mark.skipif(not _cuda_ready(), reason="needs a Hopper GPU and gmoe built with CUDA")
# Widths multiples of 16 (gmoe's CUDA GEMMs and FP8 recipes); bfloat16.
CUDA_SMALL = ["--device", "cuda", "--layers", "2", "--hidden", "128", "--heads", "4", "--experts", "8", "--top-k", "2",
              "--ffn", "128", "--seq-len", "128", "--batch", "8", "--lr", "3e-3", "--log-every", "1000", "--out", ""]


def run_cuda(*extra, steps=12):
    return lm.main(CUDA_SMALL + ["--steps", str(steps)] + [str(a) for a in extra])


@cuda_only
def test_cuda_graph_step_follows_the_eager_curve():
    """The captured step replayed under changing routing gives the eager step's losses (the
    combine's index_add uses float atomics, so equal up to summation order, not bitwise)."""
    for impl in lm.IMPLS:
        graph = run_cuda("--impl", impl, "--no-compile")[impl].losses
        eager = run_cuda("--impl", impl, "--no-compile", "--no-cuda-graph")[impl].losses
        assert max(abs(a - b) for a, b in zip(graph, eager)) <= 2e-2, (impl, graph, eager)
        assert len(set(graph)) == len(graph)  # every replay trained on its own batch


@cuda_only
@pytest.mark.parametrize("recipe", [None, "fp8_blockwise"])
def test_cuda_both_models_agree_compiled_and_captured(recipe):
    extra = ("--recipe", recipe) if recipe else ()
    results = run_cuda(*extra, steps=20)
    tol_first, _ = lm.tolerances(lm.parse_args(CUDA_SMALL + list(extra)))
    g, t = results["gmoe"].losses, results["torch"].losses
    assert max(abs(a - b) for a, b in zip(g[:lm.FIRST_STEPS], t)) <= tol_first, (g, t)
    for r in results.values():
        assert sum(r.losses[-3:]) / 3 < r.losses[0] - 0.8
        assert r.tokens_per_s and r.peak_memory_bytes


@cuda_only
def test_cuda_offloaded_activations_follow_the_eager_curve(tmp_path):
    """--offload-activations on CUDA: the gmoe step runs eagerly (offloading is not captured), with
    the activations in pinned host memory; the curve is the eager one without offloading (atomics
    in the combine: not bitwise), and the summary states the peak memory with offloading."""
    eager = run_cuda("--impl", "gmoe", "--no-compile", "--no-cuda-graph", steps=8)["gmoe"]
    off = run_cuda("--impl", "gmoe", "--no-compile", "--offload-activations", "--out", tmp_path, steps=8)["gmoe"]
    assert max(abs(a - b) for a, b in zip(off.losses, eager.losses)) <= 2e-2, (off.losses, eager.losses)
    assert off.offloaded_bytes_per_step > 0 and off.peak_memory_bytes
    assert "eager step" in off.note and "CUDA graph" not in off.note
    summary = (tmp_path / "summary.md").read_text()
    assert "Activation offloading: **on**" in summary and "peak memory with it: " in summary
    assert "ran eagerly, not in a CUDA graph" in summary


@cuda_only
def test_cuda_resume_continues_the_curve(tmp_path):
    full = run_cuda("--impl", "gmoe", steps=8)["gmoe"].losses
    run_cuda("--impl", "gmoe", "--save-dir", tmp_path, "--stop-at", 4, steps=8)
    resumed = run_cuda("--impl", "gmoe", "--resume", tmp_path, steps=8)["gmoe"].losses
    assert resumed[:4] == full[:4]
    assert max(abs(a - b) for a, b in zip(resumed, full)) <= 2e-2  # atomics in the combine: not bitwise

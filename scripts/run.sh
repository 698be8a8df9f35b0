#!/usr/bin/env bash
# scripts/run.sh — the README's main job: train a small MoE language model with gmoe, and the same
# model in plain PyTorch, on the same data (examples/train_moe_lm.py), and compare loss curves,
# tokens/s and peak memory. On an sm_90 GPU (H100/H200) it builds the CUDA backend and trains the
# example's gpu preset (CUDA graphs, torch.compile); otherwise the tiny preset on the CPU backend
# (a few minutes on two cores; the loss falls from 5.5 to about 1.7). Outputs, plot and summary go
# to build/train_moe_lm/. Extra arguments go to the example (--help lists them). The kernel
# benchmark is scripts/bench.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PYTHON="${PYTHON:-python3}"
scripts/setup_deps.sh >/dev/null
if nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | grep -q '^9\.0'; then
  device=cuda; build=--cuda
else
  device=cpu; build=--cpu-only
fi
# Builds python/gmoe/_ops.so in place (and installs torch, safetensors, matplotlib when missing).
PYTHON="$PYTHON" scripts/test_python.sh --inplace "$build" --build-only
PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" OMP_WAIT_POLICY=PASSIVE \
  exec "$PYTHON" examples/train_moe_lm.py --device "$device" "$@"

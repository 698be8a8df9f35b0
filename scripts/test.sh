#!/usr/bin/env bash
# scripts/test.sh — the README's test command: set-up, configure, build, run every test.
#
# Builds twice: the default preset (CUDA backend when nvcc is found: CPU code and CUDA compile
# checked, CUDA suites skip without a GPU) and the CPU-only preset (proves a build without nvcc
# works). Exits non-zero on any failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="$(nproc)"

scripts/setup_deps.sh
start=$(date +%s)
for preset in cpu default; do
  echo "== configure + build: $preset"
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
done
echo "== build took $(( $(date +%s) - start )) s"
for preset in cpu default; do
  echo "== tests: $preset"
  ctest --preset "$preset" -j 1
done

#!/usr/bin/env bash
# scripts/bench.sh — set-up, build, and gmoe-bench on the public suite (the main job before the
# training example; scripts/run.sh runs that now).
# On a Hopper GPU it runs the CUDA backend with baselines; without one, the CPU reference backend
# on a reduced suite (rows scaled down; about two minutes): a correctness and smoke run, whose times
# say nothing about performance. Extra arguments go to gmoe-bench.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup_deps.sh >/dev/null
cmake --preset default | grep -E "^-- gmoe: "  # says whether the CUDA backend is built
cmake --build --preset default -j "$(nproc)" --target gmoe-bench
exec build/default/gmoe-bench --suite bench/suites/public.json "$@"

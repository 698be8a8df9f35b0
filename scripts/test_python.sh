#!/usr/bin/env bash
# scripts/test_python.sh — the Python package's tests: installs what they need when it is missing
# (PyPI's torch, pinned; pytest; safetensors, numpy and matplotlib, pinned; the build backend),
# builds the package and gmoe-ckpt (GMOE_CKPT_BIN for the checkpoint tests), runs `pytest
# tests/python`, and prints how long each part took. Exits non-zero on any failure.
#
#   scripts/test_python.sh            pip install . (scikit-build-core, no build isolation, so the
#                                     extension is built against the torch installed here)
#   scripts/test_python.sh --inplace  build with CMake beside the sources (python/gmoe/_ops.so) and
#                                     test with PYTHONPATH=python: for machines where pip reaches no
#                                     registry (the GPU machine, torch preinstalled); chosen
#                                     automatically when scikit-build-core can be neither imported
#                                     nor installed
#   --build-dir DIR                   with --inplace: add the extension to an existing CMake build
#                                     folder (e.g. build/default, which scripts/gpu_check.sh built)
#                                     instead of build/python-inplace, so that libgmoe is not compiled
#                                     again; GMOE_BUILD_PYTHON is switched off there again afterwards
#   --cuda / --cpu-only               compile libgmoe's CUDA backend into the package, or not. Default:
#                                     CUDA when a GPU is visible (nvidia-smi), else CPU only — the CPU
#                                     tests need no more, and CI saves the CUDA build.
#   --build-only                      set-up and build, no tests (scripts/run.sh uses it)
#   extra arguments after --          go to pytest
# PYTHON selects the interpreter (default: python3).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="2.11.0"
SAFETENSORS_PIN="0.8.0"
NUMPY_PIN="2.4.6"
MATPLOTLIB_PIN="3.11.2"
mode=pip
cuda=auto
build_dir=""
build_only=0
pytest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --inplace) mode=inplace ;;
    --build-dir) mode=inplace; build_dir="$2"; shift ;;
    --cuda) cuda=ON ;;
    --cpu-only) cuda=OFF ;;
    --build-only) build_only=1 ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "test_python.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [[ "$cuda" == auto ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then cuda=ON; else cuda=OFF; fi
fi

t0=$(date +%s)
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "== installing torch==$TORCH_PIN from PyPI (with its CUDA runtime packages: about 2.7 GB)"
  "$PYTHON" -m pip install "torch==$TORCH_PIN"
fi
"$PYTHON" -c "import pytest" >/dev/null 2>&1 || "$PYTHON" -m pip install pytest
# The checkpoint tests and the training example write and read files with the reference
# safetensors (pinned as in scripts/setup_deps.sh); the example plots with matplotlib. Where no
# registry is reachable (the GPU machine) a missing one is reported, and the tests needing it fail.
for pin in "safetensors==$SAFETENSORS_PIN" "numpy==$NUMPY_PIN" "matplotlib==$MATPLOTLIB_PIN"; do
  "$PYTHON" -c "import ${pin%%=*}" >/dev/null 2>&1 || "$PYTHON" -m pip install "$pin" ||
    echo "== could not install $pin: the tests that need it will fail"
done
torch_version="$("$PYTHON" -c "import torch; print(torch.__version__)")"
[[ "$torch_version" == "$TORCH_PIN"* ]] || echo "== note: testing against torch $torch_version (pinned: $TORCH_PIN)"
t1=$(date +%s)

if [[ "$mode" == pip ]] && ! "$PYTHON" -c "import scikit_build_core" >/dev/null 2>&1; then
  "$PYTHON" -m pip install "scikit-build-core>=0.10" || { echo "== no scikit-build-core: building in place"; mode=inplace; }
fi
if [[ -n "$build_dir" ]]; then what="in $build_dir, CUDA backend as configured there"; else what="CUDA backend $cuda"; fi
echo "== build ($mode, $what) against torch $torch_version"
if [[ "$mode" == pip ]]; then
  "$PYTHON" -m pip install --no-build-isolation --no-deps \
    -C cmake.define.GMOE_WITH_CUDA="$cuda" -C build.verbose=false .
  pythonpath="${PYTHONPATH:-}"
elif [[ -n "$build_dir" ]]; then
  # An existing build keeps its own settings (CUDA or not, tests, tools); only the extension is added.
  cmake -S . -B "$build_dir" -DGMOE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v "$PYTHON")" >/dev/null
  build_status=0
  # gmoe-ckpt too: tests/python/test_checkpoints.py converts the files it writes with it.
  cmake --build "$build_dir" -j "$(nproc)" --target gmoe_torch_ops gmoe-ckpt || build_status=$?
  cmake -S . -B "$build_dir" -DGMOE_BUILD_PYTHON=OFF >/dev/null
  [[ $build_status -eq 0 ]] || exit $build_status
  pythonpath="$root/python${PYTHONPATH:+:$PYTHONPATH}"
  ckpt_bin="$root/$build_dir/gmoe-ckpt"
else
  cmake -S . -B build/python-inplace -G Ninja -DCMAKE_BUILD_TYPE=Release -DGMOE_WITH_CUDA="$cuda" \
    -DGMOE_BUILD_PYTHON=ON -DGMOE_BUILD_TESTS=OFF -DGMOE_BUILD_TOOLS=ON \
    -DPython_EXECUTABLE="$(command -v "$PYTHON")" >/dev/null
  cmake --build build/python-inplace -j "$(nproc)" --target gmoe_torch_ops gmoe-ckpt
  pythonpath="$root/python${PYTHONPATH:+:$PYTHONPATH}"
  ckpt_bin="$root/build/python-inplace/gmoe-ckpt"
fi
if [[ "$mode" == pip ]]; then
  # The pip build makes no tools: gmoe-ckpt (CPU only, no tests) for the checkpoint tests.
  cmake -S . -B build/python-tools -G Ninja -DCMAKE_BUILD_TYPE=Release -DGMOE_WITH_CUDA=OFF \
    -DGMOE_BUILD_TESTS=OFF -DGMOE_BUILD_TOOLS=ON >/dev/null
  cmake --build build/python-tools -j "$(nproc)" --target gmoe-ckpt
  ckpt_bin="$root/build/python-tools/gmoe-ckpt"
fi
t2=$(date +%s)
if [[ $build_only -eq 1 ]]; then
  echo "== test_python.sh: set-up $((t1 - t0)) s, build $((t2 - t1)) s (--build-only: no tests)"
  exit 0
fi

echo "== pytest tests/python"
# Run from outside the repository root so that `import gmoe` finds the installed package (pip
# mode), not the sources in python/ (which hold no extension then).
status=0
(cd tests/python && PYTHONPATH="$pythonpath" GMOE_CKPT_BIN="$ckpt_bin" OMP_WAIT_POLICY=PASSIVE \
  "$PYTHON" -m pytest -q . "${pytest_args[@]}") || status=$?
t3=$(date +%s)
echo "== test_python.sh: set-up $((t1 - t0)) s, build $((t2 - t1)) s, tests $((t3 - t2)) s, total $((t3 - t0)) s"
exit $status

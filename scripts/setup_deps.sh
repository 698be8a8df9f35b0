#!/usr/bin/env bash
# scripts/setup_deps.sh — installs what gmoe needs to build and test, idempotently.
#
#   Debian packages: GoogleTest, nlohmann-json, CLI11, ccache (only those missing; skipped where
#                    apt-get is absent or we are not root, e.g. on the GPU machine).
#   CUTLASS/CuTe:    headers from PyPI's nvidia-cutlass wheel (pinned below), unpacked into
#                    .deps/cutlass/{include,tools/util/include} (git-ignored). Nothing is done when
#                    the pinned version is already there.
#   --bundle:        also copies the Debian-provided GoogleTest sources and the nlohmann-json and
#                    CLI11 headers into .deps/, so that .deps/ alone can be carried to a machine
#                    that has no package registry (the GPU machine).
set -euo pipefail

CUTLASS_VERSION="4.2.0.0"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deps="$root/.deps"
mkdir -p "$deps"

want_pkgs=()
have_header() { [ -e "$1" ]; }
have_header /usr/include/gtest/gtest.h || want_pkgs+=(libgtest-dev googletest)
have_header /usr/include/nlohmann/json.hpp || want_pkgs+=(nlohmann-json3-dev)
have_header /usr/include/CLI/CLI.hpp || want_pkgs+=(libcli11-dev)
command -v ccache >/dev/null 2>&1 || want_pkgs+=(ccache)
command -v ninja >/dev/null 2>&1 || want_pkgs+=(ninja-build)
# clang with libFuzzer's runtime, for the bounded fuzz run of the safetensors parser.
command -v clang++ >/dev/null 2>&1 || want_pkgs+=(clang)
ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 || want_pkgs+=(libclang-rt-14-dev)
if [ ${#want_pkgs[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && [ ! -d "$deps/bundle" ]; then
    echo "setup_deps: installing ${want_pkgs[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${want_pkgs[@]}" >/dev/null
  else
    echo "setup_deps: not installing ${want_pkgs[*]} (no apt-get/root, or a bundle is present)"
  fi
fi

# Python packages of the checkpoint interop tests (files written by and for Python's safetensors).
if [ ! -d "$deps/bundle" ] && ! python3 -c "import safetensors, numpy" >/dev/null 2>&1; then
  echo "setup_deps: installing safetensors and numpy from PyPI"
  python3 -m pip install --quiet safetensors==0.8.0 numpy==2.4.6
fi

stamp="$deps/cutlass/VERSION"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$CUTLASS_VERSION" ]; then
  echo "setup_deps: fetching nvidia-cutlass==$CUTLASS_VERSION"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "nvidia-cutlass==$CUTLASS_VERSION"
  python3 - "$tmp" "$deps/cutlass.new" <<'PY'
import sys, zipfile, glob, os
whl = glob.glob(os.path.join(sys.argv[1], "nvidia_cutlass-*.whl"))[0]
out = sys.argv[2]
prefixes = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        for p in prefixes:
            if name.startswith(p) and not name.endswith("/"):
                rel = name[len("cutlass_library/source/"):]
                dst = os.path.join(out, rel)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                with z.open(name) as src, open(dst, "wb") as f:
                    f.write(src.read())
PY
  rm -rf "$deps/cutlass"
  mv "$deps/cutlass.new" "$deps/cutlass"
  echo "$CUTLASS_VERSION" > "$stamp"
fi

if [ "${1:-}" = "--bundle" ] && [ ! -d "$deps/bundle" ]; then
  echo "setup_deps: bundling GoogleTest, nlohmann-json, CLI11 into .deps/bundle"
  mkdir -p "$deps/bundle/include"
  cp -r /usr/src/googletest "$deps/bundle/googletest"
  cp -r /usr/include/nlohmann "$deps/bundle/include/"
  cp -r /usr/include/CLI "$deps/bundle/include/"
fi
echo "setup_deps: ready (CUTLASS $CUTLASS_VERSION in .deps/cutlass)"

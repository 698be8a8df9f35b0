#!/usr/bin/env bash
# scripts/test.sh — the README's test command (CI runs it): set-up, configure, build, every test.
#
# Two presets, each built and run once:
#   default  Release; the CUDA backend when nvcc is found (its code compiled, the CUDA suite
#            reported as skipped without a GPU); every CPU suite and the tool checks
#   debug    CPU only, AddressSanitizer + UBSan: proves a build without nvcc works, and runs the
#            GoogleTest suites under the sanitizers (no tools, no fuzz target: what does not
#            depend on the build, e.g. the install, fuzz and tool checks, runs in `default` only),
#            each suite without its large named shape cases (GMOE_SANITIZER_SUBSET: they run in
#            `default`, and under ASan they would take most of this run)
# then the PyTorch package: its extension added to the default build, pytest tests/python (PyPI's
# torch, pinned in scripts/test_python.sh; the CUDA tests skip without a GPU).
# Prints the time of every stage, and at the end all of them, so that growth shows in every CI
# log. Exits non-zero on the first failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
jobs="$(nproc)"

stage_times=()
run_start=$(date +%s)
report() {
  echo "== stage times"
  for t in "${stage_times[@]}"; do echo "   $t"; done
  echo "   total: $(( $(date +%s) - run_start )) s"
}
trap report EXIT
# stage NAME COMMAND...: runs COMMAND, records how long it took, and returns its exit status.
stage() {
  local name="$1" t0 took rc=0
  shift
  echo "== $name"
  t0=$(date +%s)
  "$@" || rc=$?
  took=$(( $(date +%s) - t0 ))
  stage_times+=("$(printf '%-24s %5d s' "$name:" "$took")$([ "$rc" = 0 ] || echo "  FAILED (exit $rc)")")
  echo "== $name: $took s"
  return "$rc"
}
# Each GoogleTest suite's counts (tests/run_suite.cmake prints them; ctest keeps them in its log).
suite_counts() {
  grep -h "^gmoe-suite .*passed" "build/$1/Testing/Temporary/LastTest.log" | sed 's/^/   /' || true
}

stage setup scripts/setup_deps.sh
for preset in default debug; do
  stage "configure $preset" cmake --preset "$preset"
  stage "build $preset" cmake --build --preset "$preset" -j "$jobs"
  # -j: two tests at a time. Much of the suites' time is single-threaded (the FP8 paths, the fuzz
  # runs, the install check), and OMP_WAIT_POLICY=PASSIVE (CMakeLists.txt) keeps the OpenMP parts
  # of two suites from spinning against each other.
  stage "tests $preset" ctest --preset "$preset" -j "$jobs" || { suite_counts "$preset"; exit 1; }
  suite_counts "$preset"
done
stage "python package" scripts/test_python.sh --build-dir build/default

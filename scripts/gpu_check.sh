#!/usr/bin/env bash
# scripts/gpu_check.sh — the one command run on the GPU machine (H100/H200).
#
#   scripts/gpu_check.sh [stage ...]   stages: build test sanitize bench moe tiles profile timeline train
#                                      (default: build test sanitize bench moe)
#
# build     configure with CUDA, build gmoe_tests_cuda and gmoe-bench with all cores (build/gpu)
# test      the CUDA suite in gtest shards, beside its runs with each tile, cluster, raster and row
#           chunk forced through `--tuning SPEC` (the heuristics pick one per shape)
# sanitize  compute-sanitizer memcheck and racecheck on the CUDA suite (subsets)
# bench     gmoe-bench on bench/suites/public.json (gemm, layer, mlp; cuBLAS baselines) and
#           bench/torch_baseline.py in the same session, merged by bench/report.py into the
#           baseline of this GPU: $OUT/<gpu>.json and .md (<gpu>: h100, h200), which replace
#           bench/results/<gpu>.{json,md}
# moe       the MoE block on the suite's moe cases: gmoe-bench --mode moe (MoELayer; its peak memory
#           and bytes kept for backward; permute / combine against a device copy) and
#           bench/torch_moe_baseline.py (the PyTorch composition eager and compiled, and
#           gmoe.MoELayer, the package's extension built into the build folder first), merged into
#           $OUT/moe.json and moe.md, and into $OUT/<gpu>.json and .md when they are there
# tiles     gmoe-bench's gemm mode once per forced `--tuning` setting beside the heuristics' choice
# profile   Nsight Compute sections for the GEMM kernels of the cases that miss their targets
# timeline  every kernel's duration in launch order (ncu) for a few gmoe-bench runs
# train     the PyTorch package added to the build, its tests, then examples/train_moe_lm.py (the
#           main job's GPU run: gmoe against the torch.compile'd PyTorch model, CUDA graphs);
#           $OUT/train_moe_lm/{summary.md,loss.png,losses.json}
#
# A carried build: build elsewhere (x86-64, CUDA 13.0), copy gmoe_tests_cuda, gmoe-bench and gmoe-ckpt
# into one folder and the package's extension to python/gmoe/_ops.so, carry both here and set
# GMOE_BUILD_DIR to the folder. Without a CMakeCache.txt there the test stage runs the CUDA suite
# alone, and, where python/gmoe/_ops.so is there, the train and moe stages use the carried extension
# instead of building it: train runs `pytest tests/python` (GMOE_CKPT_BIN=$GMOE_BUILD_DIR/gmoe-ckpt,
# PYTHONPATH=python, from inside tests/python as scripts/test_python.sh does) and then the example.
#
# Options (environment): GMOE_BUILD_DIR (a build made elsewhere and carried here), GMOE_BUILD_TARGETS,
# GMOE_TEST_PARTS ("suite forced"), GMOE_TEST_SHARDS (4), GMOE_GPU_CPU_SUITES=1, GMOE_SANITIZE_*,
# GMOE_BENCH_*, GMOE_TORCH_KIND, GMOE_MOE_*, GMOE_TILES, GMOE_PROFILE_SPECS, GMOE_TIMELINE, GMOE_COMMIT (the
# commit measured). Logs go to $OUT (default /tmp/gmoe_out) as logs.tgz, with summary.txt. The machine
# has no package registry: carry .deps (`scripts/setup_deps.sh --bundle`). Stages can be split over
# several calls while the machine stays warm (the build folder is kept).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 2
OUT="${OUT:-/tmp/gmoe_out}"
mkdir -p "$OUT"
# GMOE_BUILD_DIR: a build made elsewhere (x86-64, CUDA 13.0) whose binaries were carried here; the
# test stage then runs the CUDA suite alone when the CTest tree is not there.
BUILD="${GMOE_BUILD_DIR:-build/gpu}"
# A carried build with the extension carried beside it (header): there is no CMake tree to add the
# extension to, and it needs none.
carried_ext=0
if [ -n "${GMOE_BUILD_DIR:-}" ] && [ ! -f "$BUILD/CMakeCache.txt" ] && [ -f python/gmoe/_ops.so ]; then
  carried_ext=1
fi
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build test sanitize bench moe)
commit="${GMOE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
export GMOE_COMMIT="$commit"
# The baseline's name: the GPU model in lower case (NVIDIA H100 80GB HBM3 -> h100).
gpu_model="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
gpu="$(echo "$gpu_model" | grep -oiE 'h[0-9]{3}' | head -1 | tr '[:upper:]' '[:lower:]')"
gpu="${gpu:-gpu}"
status=0
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
# The device tool brings back at most 8 files: the logs travel as one archive.
# shellcheck disable=SC2317  # called by the trap
pack_logs() { (cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar czf logs.tgz ./*.log && rm -f ./*.log); }
trap pack_logs EXIT

for stage in "${stages[@]}"; do
  t0=$(date +%s)
  case "$stage" in
    build)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/summary.txt"
      scripts/setup_deps.sh >"$OUT/build.log" 2>&1
      # shellcheck disable=SC2086  # GMOE_BUILD_TARGETS is a list of targets
      if cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGMOE_WITH_CUDA=ON >>"$OUT/build.log" 2>&1 &&
         cmake --build "$BUILD" -j "$(nproc)" --target ${GMOE_BUILD_TARGETS:-gmoe_tests_cuda gmoe-bench} \
           >>"$OUT/build.log" 2>&1; then
        summary "build: ok ($(( $(date +%s) - t0 )) s)"
      else
        summary "build: FAILED"; tail -40 "$OUT/build.log"; exit 1
      fi ;;
    test)
      # The CUDA suite only: the CPU suites are CI's (they run on every submission without a GPU);
      # GMOE_GPU_CPU_SUITES=1 runs them here too. The suite runs in GMOE_TEST_SHARDS gtest shards
      # at once (default 4, each with its share of the cores for the OpenMP references), beside the
      # runs with each tile forced: most of its time is host-side references, not GPU work.
      r=ok
      : >"$OUT/tests.log"
      if [ "${GMOE_GPU_CPU_SUITES:-0}" = 1 ] && [ -f "$BUILD/CTestTestfile.cmake" ]; then
        ctest --test-dir "$BUILD" -E gmoe_tests_cuda --output-on-failure >>"$OUT/tests.log" 2>&1 ||
          { r=FAILED; status=1; }
        grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/tests.log" | tee -a "$OUT/summary.txt"
      fi
      # GMOE_TEST_PARTS (default "suite forced"): the suite's shards, the forced runs, or both
      # at once; each alone fits one device call when both together do not.
      parts="${GMOE_TEST_PARTS:-suite forced}"
      shards="${GMOE_TEST_SHARDS:-4}"
      [[ " $parts " == *" suite "* ]] || shards=0
      threads=$(( $(nproc) / (shards + 2) )); [ "$threads" -lt 1 ] && threads=1
      pids=()
      for ((i = 0; i < shards; i++)); do
        # Not brief: the logs keep every test's time (the suite's runtime is GPU time).
        GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i OMP_NUM_THREADS=$threads \
          "$BUILD/gmoe_tests_cuda" >"$OUT/cuda_tests.$i.log" 2>&1 &
        pids+=($!)
      done
      # The heuristics pick one kernel per shape: force each choice in turn so every kernel runs.
      forced() {  # name, --tuning spec, filter
        if OMP_NUM_THREADS=$threads "$BUILD/gmoe_tests_cuda" --tuning "$2" --gtest_brief=1 --gtest_filter="$3" \
             >"$OUT/forced_$1.log" 2>&1; then echo "test forced $1: ok"; else echo "test forced $1: FAILED"; return 1; fi
      }
      rows_filter='LargeCases/CudaGroupedGemm*:CudaGroupedGemmGraph*:CudaGroupedGemmTiles*:NamedCases/CudaGroupedGemm*e256:NamedCases/CudaGroupedGemm*ragged:*CudaGroupedGemmActivation*'
      if [[ " $parts " == *" forced "* ]]; then
        { forced tile_coop tile=coop "$rows_filter"; forced raster_m raster=m '*Wgrad*'; } \
          >"$OUT/forced_status_a.txt" &
        pids+=($!)
        { forced tile_pingpong tile=pingpong "$rows_filter"; forced raster_n raster=n '*Wgrad*'; } \
          >"$OUT/forced_status_b.txt" &
        pids+=($!)
        # Row chunks of 256 rows, on the tests whose groups that chunk splits (169): the large GEMM
        # cases, the layers' and MLPs' parameterised cases, the large FP8 GEMMs and the graph
        # captures. The other tests of those suites (named shapes, options, errors) are not split
        # by it, so forcing it changes nothing for them, and all of them together (1077 of the
        # 1448 tests) take longer than one device call allows.
        forced row_chunk_256 row_chunk=256 \
          'LargeCases/CudaGroupedGemm*:Cases/CudaGroupedLinear.*:Cases/CudaGroupedMlp.*:CudaFp8GemmLarge*:CudaGroupedGemmGraph*:CudaGroupedLinearGraph*' \
          >"$OUT/forced_status_c.txt" &
        pids+=($!)
        # Clusters: the heuristics keep the named cases' fprop/dgrad on 1x1 and their weight
        # gradients on 2x1; force each the other way, and the bf16 and FP8 fprop/dgrad into 2x2.
        { forced cluster_2x1 cluster=2x1 "$rows_filter:*CudaFp8Gemm*:*CudaGroupedLinearFp8*";
          forced cluster_2x2 cluster=2x2 "$rows_filter:*CudaFp8Gemm*:*CudaGroupedLinearFp8*";
          forced cluster_1x1 cluster=1x1 '*Wgrad*:*CudaFp8Gemm*'; } >"$OUT/forced_status_d.txt" &
        pids+=($!)
      fi
      for p in "${pids[@]}"; do wait "$p" || { r=FAILED; status=1; }; done
      if [[ " $parts " == *" forced "* ]]; then
        cat "$OUT"/forced_status_*.txt | tee -a "$OUT/summary.txt"
        rm -f "$OUT"/forced_status_*.txt
        cat "$OUT"/forced_*.log >>"$OUT/tests.log" && rm -f "$OUT"/forced_*.log
      fi
      for ((i = 0; i < shards; i++)); do
        grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]" "$OUT/cuda_tests.$i.log" | head -40 |
          sed "s/^/shard $i: /" | tee -a "$OUT/summary.txt"
        cat "$OUT/cuda_tests.$i.log" >>"$OUT/cuda_tests.log" && rm -f "$OUT/cuda_tests.$i.log"
      done
      summary "test: $r ($(( $(date +%s) - t0 )) s)" ;;
    sanitize)
      : >"$OUT/sanitizer.log"
      for tool in ${GMOE_SANITIZE_TOOLS:-memcheck racecheck}; do
        filter="${GMOE_SANITIZE_FILTER:-*Errors*:*Clamp*:*skewed*:*ragged*:*all_empty*:*zero_total*:*e256*:*Graph*:*CudaFp8Grouped*bf16*:*CudaFp8Weights*bf16*-*CudaGroupedMlp.*:*CudaGroupedMlpOptions.*:*CudaGroupedMlpFp8*}"
        [ "$tool" = racecheck ] && filter="${GMOE_RACECHECK_FILTER:-*Graph*:*bf16_stacked_skewed*:*stacked_biaslist_uniform*}"
        echo "== compute-sanitizer --tool $tool (filter $filter)" >>"$OUT/sanitizer.log"
        if timeout "${GMOE_SANITIZE_TIMEOUT:-280}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
             "$BUILD/gmoe_tests_cuda" --gtest_brief=1 --gtest_filter="$filter" >>"$OUT/sanitizer.log" 2>&1; then
          summary "sanitize $tool: clean"
        else
          summary "sanitize $tool: FAILED or timed out (rc $?)"; status=1
        fi
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer.log" | tail -1 | tee -a "$OUT/summary.txt"
      done ;;
    bench)
      # GMOE_BENCH_MODE (a list of gemm, layer, mlp, moe, all; default "gemm layer mlp": the moe
      # cases are the moe stage's, which runs their PyTorch baselines beside them) and the FP8 recipes of the
      # gemm and layer modes (GMOE_BENCH_FP8, GMOE_BENCH_LAYER_FP8; "none" for none) narrow a run to
      # what a session still needs; torch runs beside it, once per kind in GMOE_TORCH_KIND (default
      # "all layer": torch_baseline.py's all is gemm and mlp; layer compiles each shape anew, so
      # a narrowed run names only what it needs, or "none"). GMOE_BENCH_EXTRA (default "offload
      # module"): gmoe-bench --mode offload, and bench/torch_module_bench.py (the PyTorch package
      # against the C++ layer). The whole stage takes longer than one device call: split it over
      # calls with these variables and merge the $gpu.json files with bench/report.py.
      # GMOE_BENCH_WARM_MS (default 1000): the sustained work before each layer and mlp timing, in
      # both gmoe-bench and torch (0: a second less per timing, those timed at boost clocks instead).
      warm="${GMOE_BENCH_WARM_MS:-1000}"
      fp8="${GMOE_BENCH_FP8:-blockwise,tensorwise,tensorwise_fast,mxfp8}"
      layer_fp8="${GMOE_BENCH_LAYER_FP8:-fp8_blockwise,fp8_tensorwise,mxfp8}"
      fp8_args=()
      [ "$fp8" != none ] && fp8_args+=(--fp8 "$fp8")
      [ "$layer_fp8" != none ] && fp8_args+=(--layer-fp8 "$layer_fp8")
      : >"$OUT/bench.log"
      for mode in ${GMOE_BENCH_MODE:-gemm layer mlp}; do
        "$BUILD/gmoe-bench" --suite bench/suites/public.json --mode "$mode" --iters 20 --warm-ms "$warm" \
          "${fp8_args[@]}" --json "$OUT/gmoe_$mode.json" >>"$OUT/bench.log" 2>&1 || status=1
      done
      grep -E "^  E = |the same for E = 8 and E = 256" "$OUT/bench.log" | tee -a "$OUT/summary.txt"
      tail -5 "$OUT/bench.log" | tee -a "$OUT/summary.txt"
      for extra in ${GMOE_BENCH_EXTRA:-offload module}; do
        case "$extra" in
          offload) "$BUILD/gmoe-bench" --suite bench/suites/public.json --mode offload --iters 20 --warm-ms "$warm" \
                     --json "$OUT/gmoe_offload.json" >>"$OUT/bench.log" 2>&1 || status=1 ;;
          module) PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 python3 bench/torch_module_bench.py \
                    --gmoe-bench "$BUILD/gmoe-bench" --warm-ms "$warm" --json "$OUT/torch_module.json" \
                    >>"$OUT/bench.log" 2>&1 || summary "torch_module_bench: FAILED (is the package built?)" ;;
          none) ;;
          *) summary "GMOE_BENCH_EXTRA: unknown '$extra'"; status=1 ;;
        esac
      done
      for kind in ${GMOE_TORCH_KIND:-all layer}; do
        [ "$kind" = none ] && continue
        PYTHONUNBUFFERED=1 python3 bench/torch_baseline.py --suite bench/suites/public.json --iters 20 \
          --warm-ms "$warm" --kind "$kind" --json "$OUT/torch_$kind.json" >>"$OUT/bench.log" 2>&1 ||
          summary "torch baseline ($kind): FAILED"
      done
      # The whole baseline of this GPU, to be copied over bench/results/$gpu.{json,md}.
      python3 bench/report.py "$OUT"/gmoe_*.json "$OUT"/torch_*.json --out "$OUT/$gpu.json" \
        --markdown "$OUT/$gpu.md" | tee -a "$OUT/bench.log"
      rm -f "$OUT"/gmoe_*.json "$OUT"/torch_*.json
      summary "bench: done, $OUT/$gpu.json and $gpu.md ($(( $(date +%s) - t0 )) s)" ;;
    moe)
      # GMOE_MOE_SUITE: the suite (default bench/suites/public.json); GMOE_MOE_CASE: only the moe
      # cases whose name contains it (default: all of them);
      # GMOE_MOE_TORCH=0: gmoe-bench alone; GMOE_MOE_PACKAGE=0: no extension build (gmoe_torch is then
      # reported absent unless the package is importable anyway); GMOE_MOE_COMPILE=0: no
      # torch.compile (about a minute per shape). The warm-up is the bench stage's (GMOE_BENCH_WARM_MS).
      warm="${GMOE_BENCH_WARM_MS:-1000}"
      moe_suite="${GMOE_MOE_SUITE:-bench/suites/public.json}"
      moe_case="${GMOE_MOE_CASE:-}"
      : >"$OUT/moe.log"
      "$BUILD/gmoe-bench" --suite "$moe_suite" --mode moe --case "$moe_case" --iters 20 \
        --warm-ms "$warm" --json "$OUT/moe_gmoe.json" >>"$OUT/moe.log" 2>&1 || { status=1; summary "moe: gmoe-bench FAILED"; }
      grep -E "INCORRECT|SKIPPED|correctness" "$OUT/moe.log" | tee -a "$OUT/summary.txt"
      moe_inputs=("$OUT/moe_gmoe.json")
      if [ "${GMOE_MOE_TORCH:-1}" = 1 ]; then
        if [ "${GMOE_MOE_PACKAGE:-1}" = 1 ] && [ "$carried_ext" = 1 ]; then
          summary "moe: the PyTorch package's extension carried (python/gmoe/_ops.so), not built"
        elif [ "${GMOE_MOE_PACKAGE:-1}" = 1 ]; then
          # The package's extension, added to this build (scripts/test_python.sh --build-dir does the same).
          if cmake -S . -B "$BUILD" -DGMOE_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" >>"$OUT/moe.log" 2>&1 &&
             cmake --build "$BUILD" -j "$(nproc)" --target gmoe_torch_ops >>"$OUT/moe.log" 2>&1; then
            summary "moe: the PyTorch package's extension built"
          else
            summary "moe: the PyTorch package's extension did not build (gmoe_torch absent; see moe.log)"
          fi
          cmake -S . -B "$BUILD" -DGMOE_BUILD_PYTHON=OFF >/dev/null 2>&1
        fi
        compile_args=()
        [ "${GMOE_MOE_COMPILE:-1}" = 1 ] || compile_args=(--no-compile)
        PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 python3 bench/torch_moe_baseline.py \
          --suite "$moe_suite" --case "$moe_case" --iters 20 --warm-ms "$warm" "${compile_args[@]}" \
          --json "$OUT/moe_torch.json" >>"$OUT/moe.log" 2>&1 || summary "moe: torch baseline FAILED (or gmoe_torch incorrect)"
        moe_inputs+=("$OUT/moe_torch.json")
      fi
      python3 bench/report.py "${moe_inputs[@]}" --out "$OUT/moe.json" --markdown "$OUT/moe.md" >>"$OUT/moe.log" 2>&1 ||
        status=1
      sed -n '/^## MoE block/,$p' "$OUT/moe.md" | head -60 | tee -a "$OUT/summary.txt"
      if [ -f "$OUT/$gpu.json" ]; then
        # This GPU's whole baseline (the bench stage's): its moe rows, if any, replaced by these.
        python3 - "$OUT/$gpu.json" <<'PY' && python3 bench/report.py "$OUT/$gpu.json" "$OUT/moe.json" \
          --out "$OUT/$gpu.json" --markdown "$OUT/$gpu.md" >/dev/null || status=1
import json, sys
d = json.load(open(sys.argv[1]))
d["rows"] = [r for r in d["rows"] if r.get("kind") != "moe"]
json.dump(d, open(sys.argv[1], "w"), indent=1)
PY
      fi
      rm -f "$OUT/moe_gmoe.json" "$OUT/moe_torch.json"
      summary "moe: done, $OUT/moe.json and moe.md ($(( $(date +%s) - t0 )) s)" ;;
    tiles)
      # gmoe-bench's gemm mode once per forced setting (GMOE_TILES: --tuning specs, default each
      # tile config, weight-gradient tile order and cluster), no baselines, beside the heuristics'
      # choice from the bench stage: the data the tile, raster and cluster heuristics are tuned on.
      for spec in ${GMOE_TILES:-tile=coop tile=pingpong raster=m raster=n cluster=1x1 cluster=2x1 cluster=2x2}; do
        name="$(echo "$spec" | tr '=,' '__')"
        "$BUILD/gmoe-bench" --tuning "$spec" --suite bench/suites/public.json --mode gemm --iters 20 \
          --no-baselines ${GMOE_TILES_PASS:+--pass $GMOE_TILES_PASS} --json "/tmp/gmoe_tile_$name.json" \
          >>"$OUT/bench.log" 2>&1 || status=1
      done
      python3 - "$OUT/$gpu.json" /tmp/gmoe_tile_*.json >"$OUT/tiles.md" <<'PY' || status=1
import json, sys
sys.path.insert(0, "bench")
import report
rows, tiles = [], []
for path in sys.argv[1:]:
    try:
        d = json.load(open(path))
    except (OSError, ValueError):
        continue
    tile = path.rsplit("gmoe_tile_", 1)[1][:-5] if "gmoe_tile_" in path else None
    for r in d["rows"]:
        if r["impl"] == "gmoe":
            rows.append(dict(r, impl="gmoe_" + tile) if tile else r)
    if tile:
        tiles.append("gmoe_" + tile)
base = ["gmoe"] if any(r["impl"] == "gmoe" for r in rows) else tiles[:1]
lines = report.table(rows, base, [t for t in tiles if t not in base], {"fprop", "dgrad", "wgrad"})
print("# Forced settings (gmoe: the heuristics' choice, from the bench stage)\n")
report.write_markdown_table(sys.stdout, lines)
PY
      cat "$OUT/tiles.md"
      summary "tiles: done ($(( $(date +%s) - t0 )) s)" ;;
    profile)
      # One kernel per spec (case|pass|kernel-name regex on the demangled name|extra gmoe-bench
      # flags): the correctness run's launch, profiled with the speed-of-light, memory, occupancy
      # and warp-state sections. The cases are those that miss their targets: bf16 wgrad of
      # mixtral_fc1 (below dense cuBLAS) and small_m/skewed (below torch), FP8 blockwise fprop of
      # dsv3_fc1 (below 1150 TFLOP/s) and its weight gradient (below our bf16).
      # GMOE_PROFILE_SPECS replaces the list: ';'-separated "kernel regex|gmoe-bench arguments".
      : >"$OUT/ncu.txt"
      specs="${GMOE_PROFILE_SPECS:-device_kernel|--mode gemm --case mixtral_fc1/uniform --pass wgrad --no-baselines;device_kernel|--mode gemm --case small_m/skewed --pass wgrad --no-baselines;e4m3|--mode gemm --case dsv3_fc1/uniform --pass fprop --no-baselines --fp8 blockwise;e4m3|--mode gemm --case dsv3_fc1/uniform --pass wgrad --no-baselines --fp8 blockwise --fp8-wgrad-out f32}"
      IFS=';' read -r -a spec_list <<<"$specs"
      for spec in "${spec_list[@]}"; do
        IFS='|' read -r kname args <<<"$spec"
        echo "== $kname: $args" >>"$OUT/ncu.txt"
        # shellcheck disable=SC2086
        timeout "${GMOE_PROFILE_TIMEOUT:-120}" ncu --kernel-name-base demangled --kernel-name regex:"$kname" \
          --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
          --section WarpStateStats --section LaunchStats --print-summary none \
          "$BUILD/gmoe-bench" --suite bench/suites/public.json $args --iters 1 --warmup 0 \
          >>"$OUT/ncu.txt" 2>&1 || status=1
      done
      grep -E "^== |Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall" \
        "$OUT/ncu.txt" | tail -60
      summary "profile: done ($(( $(date +%s) - t0 )) s)" ;;
    timeline)
      # Every kernel's duration, in launch order, for the first launches of gmoe-bench runs (one
      # run per ';'-separated argument list in GMOE_TIMELINE; default the GroupedMLP of dsv3_ep32
      # and its two GEMMs alone): Nsight Compute with clocks and caches left as they are, so that
      # the sum of a layer's kernels can be set against its CUDA-event time and against its parts
      # timed alone. timeline.txt
      : >"$OUT/timeline.txt"
      IFS=';' read -r -a runs <<<"${GMOE_TIMELINE:---mode mlp --case dsv3_ep32/uniform;--mode gemm --case dsv3_fc1/uniform --no-baselines;--mode gemm --case dsv3_fc2/uniform --no-baselines}"
      for args in "${runs[@]}"; do
        echo "== gmoe-bench $args" >>"$OUT/timeline.txt"
        # shellcheck disable=SC2086
        timeout "${GMOE_PROFILE_TIMEOUT:-120}" ncu --csv --print-units base --metrics gpu__time_duration.sum \
          --clock-control none --cache-control none --launch-count "${GMOE_TIMELINE_LAUNCHES:-60}" \
          "$BUILD/gmoe-bench" --suite bench/suites/public.json $args --iters 1 --warmup 0 --warm-ms 0 \
          >/tmp/gmoe_timeline.csv 2>>"$OUT/timeline.log" || status=1
        cat /tmp/gmoe_timeline.csv >>"$OUT/timeline.log"
        python3 - /tmp/gmoe_timeline.csv >>"$OUT/timeline.txt" <<'PY' || status=1
import csv, re, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
if not rows:
    sys.exit("no ncu rows")
head, body = rows[0], rows[1:]
name, val = head.index("Kernel Name"), head.index("Metric Value")
grid = head.index("Grid Size") if "Grid Size" in head else None
total = 0.0
for r in body:
    us = float(r[val].replace(",", "")) / 1e3
    total += us
    short = re.sub(r"\(.*", "", r[name])[:90]
    print(f"{us:10.1f} us  {r[grid] if grid is not None else '':>16}  {short}")
print(f"{total:10.1f} us  total of {len(body)} kernels")
PY
      done
      tail -150 "$OUT/timeline.txt"
      summary "timeline: done ($(( $(date +%s) - t0 )) s)" ;;
    train)
      if [ "$carried_ext" = 1 ]; then
        # The carried extension and gmoe-ckpt: the package's tests as scripts/test_python.sh runs
        # them (from inside tests/python), without its build.
        ckpt_bin="$(cd "$BUILD" && pwd)/gmoe-ckpt"
        python_tests() {
          (cd tests/python && PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}" GMOE_CKPT_BIN="$ckpt_bin" \
            OMP_WAIT_POLICY=PASSIVE python3 -m pytest -q .)
        }
      else
        python_tests() { scripts/test_python.sh --build-dir "$BUILD"; }
      fi
      if python_tests >"$OUT/train.log" 2>&1 &&
         PYTHONPATH=python python3 examples/train_moe_lm.py --out "$OUT/train_moe_lm" >>"$OUT/train.log" 2>&1; then
        summary "train: ok ($(( $(date +%s) - t0 )) s)"
        grep -E "^\| (gmoe|torch) |^Agreement|^Speed|^Peak" "$OUT/train_moe_lm/summary.md" | tee -a "$OUT/summary.txt"
      else
        summary "train: FAILED"; tail -40 "$OUT/train.log"; status=1
      fi ;;
    *) echo "unknown stage '$stage'"; exit 2 ;;
  esac
done
exit $status

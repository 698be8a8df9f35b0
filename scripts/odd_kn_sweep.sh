#!/usr/bin/env bash
# scripts/odd_kn_sweep.sh — the bf16 grouped GEMM kernels that choose_rows_tile (fprop/dgrad) and
# choose_wgrad_tile pick among, each forced in turn, on shapes whose K or N is a multiple of 8 but
# not of 64 (issue 41) and on aligned controls of nearly the same size, printed as one table of ms
# per case, pass and variant: the data that rows_tile_rule (src/cuda/gemm/rows_tile_rule.h) is
# decided on.
#
#   scripts/odd_kn_sweep.sh [BUILD_DIR]     (default build/default; gmoe-bench built there)
#
# Cases: the public suite's odd_kn cases, and generated ones (E = 24, K x N):
#   odd_r{256,512,1024}    1400 x 2888, 256/512/1024 rows per expert: both operands' rows off the
#                          128-byte lines (2800 B and 5776 B), at three group heights
#   oddk_r1024 1400 x 2880 (K odd: x and W rows off the lines, y on them)
#   oddn_r1024 1408 x 2888 (N odd: dy and y rows off the lines, W on them)
#   aligned_r{512,1024}    1408 x 2880: the control
# Variants (--tuning): auto (the heuristics), tile=coop,cluster=1x1, tile=coop,cluster=2x1,
# tile=coop,cluster=2x2 (bf16 dgrad; fprop and the weight gradient have no 2x2 instance and run 2x1),
# tile=pingpong. Two rounds in alternating order, the smaller time of the two kept (gemm mode
# times bursts: the clocks move between runs). SWEEP_ROUNDS, SWEEP_VARIANTS override; SWEEP_TORCH=1
# also runs bench/torch_baseline.py (torch._grouped_mm) on the same cases for the torch column.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
BUILD="${1:-build/default}"
BENCH="$BUILD/gmoe-bench"
[ -x "$BENCH" ] || { echo "odd_kn_sweep: $BENCH not built" >&2; exit 2; }
PYTHON="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$PYTHON" - "$work/suite.json" <<'PY'
import json, sys
public = json.load(open("bench/suites/public.json"))
cases = [c for c in public["cases"] if c["kind"] == "gemm" and c["name"].startswith("odd_kn")]
E = 24
def uniform(name, K, N, rows_per_expert):
    return {"kind": "gemm", "name": name, "E": E, "rows": E * rows_per_expert, "K": K, "N": N,
            "counts": [rows_per_expert] * E}
for r in (256, 512, 1024):
    cases.append(uniform(f"odd_r{r}", 1400, 2888, r))
cases.append(uniform("oddk_r1024", 1400, 2880, 1024))
cases.append(uniform("oddn_r1024", 1408, 2888, 1024))
for r in (512, 1024):
    cases.append(uniform(f"aligned_r{r}", 1408, 2880, r))
json.dump({"name": "odd_kn_sweep", "about": "scripts/odd_kn_sweep.sh", "cases": cases}, open(sys.argv[1], "w"))
PY

variants="${SWEEP_VARIANTS:-auto tile=coop,cluster=1x1 tile=coop,cluster=2x1 tile=coop,cluster=2x2 tile=pingpong}"
rounds="${SWEEP_ROUNDS:-2}"
for ((round = 0; round < rounds; round++)); do
  list=$variants
  # Every other round runs the variants in reverse, so no variant always follows the same one.
  if ((round % 2 == 1)); then list=$(echo "$variants" | tr ' ' '\n' | tac | tr '\n' ' '); fi
  for v in $list; do
    spec=$v; [ "$v" = auto ] && spec=""
    name="$(echo "$v" | tr '=,' '__')"
    baselines=--no-baselines
    [ "$round" = 0 ] && [ "$v" = auto ] && baselines=""  # cuBLAS dense once, for reference
    echo "odd_kn_sweep: round $round, $v"
    "$BENCH" --suite "$work/suite.json" --mode gemm --iters 30 $baselines ${spec:+--tuning "$spec"} \
      --json "$work/r${round}_$name.json" >"$work/r${round}_$name.log" 2>&1 ||
      { echo "odd_kn_sweep: gmoe-bench failed for $v:"; tail -20 "$work/r${round}_$name.log"; exit 1; }
  done
done
if [ "${SWEEP_TORCH:-0}" = 1 ]; then
  echo "odd_kn_sweep: torch._grouped_mm"
  "$PYTHON" bench/torch_baseline.py --suite "$work/suite.json" --kind gemm --no-fp8 --iters 30 \
    --json "$work/torch.json" >"$work/torch.log" 2>&1 || { echo "odd_kn_sweep: torch baseline failed:"; tail -20 "$work/torch.log"; }
fi

"$PYTHON" - "$work" "$variants" <<'PY'
import glob, json, os, sys
work, variants = sys.argv[1], sys.argv[2].split()
best = {}  # (case, pass, column) -> ms
order = []
def put(key, ms):
    if key[:2] not in order:
        order.append(key[:2])
    best[key] = min(ms, best.get(key, float("inf")))
for path in sorted(glob.glob(os.path.join(work, "r*_*.json"))):
    v = os.path.basename(path).split("_", 1)[1][:-5]
    for r in json.load(open(path))["rows"]:
        if r.get("ms") is None or r.get("correct") is False:
            continue
        col = v if r["impl"] == "gmoe" else r["impl"]
        put((r["case"], r["pass"], col), r["ms"])
torch_path = os.path.join(work, "torch.json")
if os.path.exists(torch_path):
    for r in json.load(open(torch_path))["rows"]:
        if r.get("impl", "").startswith("torch") and r.get("ms") is not None and r.get("dtype", "bf16") == "bf16":
            put((r["case"], r["pass"], r["impl"]), r["ms"])
cols = [v.replace("=", "_").replace(",", "_") for v in variants]
extra = sorted({k[2] for k in best} - set(cols))
cols += extra
has_torch = "torch" in cols
print("ms (the smaller of the rounds); fastest: the fastest variant" +
      ("; x torch: torch's time over auto's and over the fastest variant's (> 1: gmoe faster)" if has_torch else ""))
print("| case | pass | " + " | ".join(cols) + " | fastest |" + (" auto x torch | fastest x torch |" if has_torch else ""))
print("|---|---|" + "---|" * (len(cols) + 1 + (2 if has_torch else 0)))
for case, p in order:
    cells = [best.get((case, p, c)) for c in cols]
    gm = {c: best[(case, p, c)] for c in cols[:len(variants)] if (case, p, c) in best}
    fastest = min(gm, key=gm.get) if gm else "-"
    line = f"| {case} | {p} | " + " | ".join("-" if x is None else f"{x:.4f}" for x in cells) + f" | {fastest} |"
    if has_torch:
        t = best.get((case, p, "torch"))
        ratio = lambda ms: "-" if t is None or ms is None else f"{t / ms:.3f}"
        line += f" {ratio(gm.get('auto'))} | {ratio(gm.get(fastest))} |"
    print(line)
PY

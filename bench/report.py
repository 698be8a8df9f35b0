#!/usr/bin/env python3
"""bench/report.py — merges result files of one GPU session (gmoe-bench --json, torch_baseline.py
--json) into one results file in the BENCHMARKS.md format, and prints one table: TFLOP/s of every
implementation per case and pass, gmoe's ratio to each baseline, and the geometric means.

    report.py gmoe.json torch.json --out results.json --markdown results.md
"""
import argparse
import json
import math


def table(rows):
    keys, cells, impls = [], {}, []
    for r in rows:
        k = (r["case"], r["pass"])
        if k not in cells:
            keys.append(k)
            cells[k] = {}
        cells[k][r["impl"]] = r
        if r["impl"] not in impls:
            impls.append(r["impl"])
    baselines = [i for i in impls if i != "gmoe"]
    head = ["case", "pass"] + [f"{i} TFLOP/s" for i in impls] + [f"gmoe/{b}" for b in baselines] + ["correct"]
    lines = [head]
    logs = {b: [] for b in baselines}
    for k in keys:
        c = cells[k]
        line = list(k) + [f"{c[i]['tflops']:.1f}" if i in c else "-" for i in impls]
        g = c.get("gmoe")
        for b in baselines:
            if g and b in c and c[b]["tflops"] > 0:
                ratio = g["tflops"] / c[b]["tflops"]
                logs[b].append(math.log(ratio))
                line.append(f"{ratio:.2f}x")
            else:
                line.append("-")
        line.append("-" if not g or g.get("correct") is None else ("yes" if g["correct"] else "NO"))
        lines.append(line)
    geo = ["geomean", ""] + [""] * len(impls)
    geo += [f"{math.exp(sum(v) / len(v)):.2f}x" if v else "-" for v in logs.values()] + [""]
    lines.append(geo)
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    merged = None
    for path in args.inputs:
        try:
            d = json.load(open(path))
        except (OSError, ValueError) as e:
            print(f"report: skipping {path}: {e}")
            continue
        if merged is None:
            merged = {k: d.get(k) for k in ("gpu", "commit", "date", "suite")}
            merged["rows"] = []
        if "torch" in d:
            merged["torch"] = d["torch"]
        merged["rows"] += d["rows"]
    json.dump(merged, open(args.out, "w"), indent=1)
    lines = table(merged["rows"])
    widths = [max(len(l[i]) for l in lines) for i in range(len(lines[0]))]
    for n, l in enumerate(lines):
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(l, widths))))
        if n == 0:
            print("-" * (sum(widths) + 2 * len(widths)))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# gmoe benchmark: suite {merged.get('suite')} on {merged.get('gpu')}\n\n")
            f.write(f"commit {merged.get('commit')}, {merged.get('date')}, torch {merged.get('torch')}. "
                    "TFLOP/s (median of CUDA-event timings); every baseline measured in the same run.\n\n")
            for n, l in enumerate(lines):
                f.write("| " + " | ".join(l) + " |\n")
                if n == 0:
                    f.write("|" + "---|" * 2 + "---:|" * (len(l) - 2) + "\n")


if __name__ == "__main__":
    main()

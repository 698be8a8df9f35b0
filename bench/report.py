#!/usr/bin/env python3
"""bench/report.py — merges result files of one GPU session (gmoe-bench --json, torch_baseline.py
--json, torch_moe_baseline.py --json) into one results file in the docs/benchmarks.md format, and
prints one table: TFLOP/s of every implementation per case and pass, gmoe's ratio to each baseline,
and the geometric means. Layer rows (impl gmoe_linear, from gmoe-bench's layer mode) get a second
table: the layer's time beside its bare GEMMs measured in the same run, the overhead, and the kernel
launches per call. Rows of moe cases (kind "moe") get tables of their own: the MoE block forward +
backward, gmoe against the PyTorch composition eager and compiled, with the bytes kept for backward
per token and the peak memory of each; and permute / combine against a device copy. Rows of
gmoe-bench --mode offload (kind "offload") get the activation offloading tables: the step with and
without offloading, the activations' memory, and the offloader's copies against a plain pinned copy.
Rows of bench/torch_module_bench.py (kind "module") get the PyTorch package's tables: its module
against the C++ layer and the torch composition timed in that session, and the per-call overhead of
its ops.

    report.py gmoe.json torch.json --out results.json --markdown results.md
"""
import argparse
import json
import math
import re


LAYER_IMPL = "gmoe_linear"


# The comparison tables: which of our implementations are compared with which baselines.
# Each row of a table is a (case, pass); a section is printed only when it has rows.
GEMM_SECTION = ("bf16 grouped GEMM", ["gmoe"], ["cublas_dense", "cublas_loop", "torch"])
FP8_IMPLS = ["gmoe_fp8_blockwise", "gmoe_fp8_tensorwise", "gmoe_fp8_tensorwise_fast", "gmoe_mxfp8"]
FP8_SECTION = ("FP8 grouped GEMM alone (torch_fp8_rowwise: use_fast_accum=False, _fast: True; "
               "torch_fp8_blockwise: torch._scaled_mm per expert, DeepSeek-V3's scales, cuBLASLt)",
               FP8_IMPLS, ["gmoe", "torch_fp8_rowwise", "torch_fp8_rowwise_fast", "torch_fp8_blockwise"])
FP8_QUANT_SECTION = ("FP8 quantization of the pass's activations + grouped GEMM, vs the bf16 GEMM",
                     [i + "_with_quant" for i in FP8_IMPLS], ["gmoe"])
MLP_SECTION = ("expert MLP", ["gmoe", "gmoe_unfused"], ["torch", "torch_compile"])
# GroupedLinear against torch's layer composition (torch_baseline.py --kind layer): bf16 against
# bf16, each FP8 recipe against torch's FP8 rowwise layer (eager and compiled).
LAYER_TORCH_BF16 = ("GroupedLinear (bias, f32 main_grad) against the torch composition with _grouped_mm",
                    [LAYER_IMPL], ["torch_linear"])
LAYER_TORCH_FP8_TITLE = ("GroupedLinear with FP8 recipes against the torch composition with _scaled_grouped_mm "
                         "rowwise, its quantization timed (eager and compiled)")
LAYER_TORCH_FP8_BASELINES = ["torch_linear_fp8_rowwise", "torch_linear_fp8_rowwise_compile"]


def cell(row):
    """A row's TFLOP/s as a table cell ("skipped" for a row that was not run)."""
    return "skipped" if row.get("skipped") else f"{row['tflops']:.1f}"


def skipped_lines(rows):
    """'case impl: reason', once per case, impl and reason (a skipped case skips all its passes)."""
    out = []
    for r in rows:
        line = f"{r['case']} {r['impl']}: {r['skipped']}" if r.get("skipped") else None
        if line and line not in out:
            out.append(line)
    return out


def skipped_row(error):
    """A row in the docs/benchmarks.md format for an error record {case, pass, impl, error}."""
    reason = error["error"]
    reason = reason[len("skipped: "):] if reason.startswith("skipped: ") else reason
    return {"case": error["case"], "pass": error["pass"], "impl": error["impl"],
            "dtype": "fp8" if "fp8" in error["impl"] else "bf16", "ms": None, "tflops": None, "correct": None,
            "skipped": reason}


def table(rows, ours, baselines, passes=None):
    """TFLOP/s of every implementation present, and the ratio of each of ours to each baseline, per
    (case, pass); geometric mean of every ratio column. `passes` limits the passes taken."""
    wanted = set(ours) | set(baselines)
    keys, cells, present = [], {}, []
    for r in rows:
        if r["impl"] not in wanted or (passes and r["pass"] not in passes):
            continue
        k = (r["case"], r["pass"])
        if k not in cells:
            keys.append(k)
            cells[k] = {}
        cells[k][r["impl"]] = r
        if r["impl"] not in present:
            present.append(r["impl"])
    keys = [k for k in keys if any(o in cells[k] for o in ours)]  # rows without any of ours: none
    if not keys:
        return []
    impls = [i for i in list(ours) + list(baselines) if i in present]
    pairs = [(o, b) for o in ours if o in present for b in baselines if b in present and b != o]
    head = ["case", "pass"] + [f"{i} TFLOP/s" for i in impls] + [f"{o}/{b}" for o, b in pairs] + ["correct"]
    lines = [head]
    logs = {p: [] for p in pairs}
    for k in keys:
        c = cells[k]
        line = list(k) + [cell(c[i]) if i in c else "-" for i in impls]
        for o, b in pairs:
            if o in c and b in c and (c[b]["tflops"] or 0) > 0 and (c[o]["tflops"] or 0) > 0:
                ratio = c[o]["tflops"] / c[b]["tflops"]
                logs[(o, b)].append(math.log(ratio))
                line.append(f"{ratio:.2f}x")
            else:
                line.append("-")
        checked = [c[o].get("correct") for o in ours if o in c and c[o].get("correct") is not None]
        line.append("-" if not checked else ("yes" if all(checked) else "NO"))
        lines.append(line)
    geo = ["geomean", ""] + [""] * len(impls)
    geo += [f"{math.exp(sum(v) / len(v)):.2f}x" if v else "-" for v in logs.values()] + [""]
    lines.append(geo)
    return lines


def sections(rows):
    """(title, lines) of every comparison table that has rows."""
    out = []
    gemm_passes = {"fprop", "dgrad", "wgrad"}
    for title, ours, baselines in (GEMM_SECTION, FP8_SECTION, FP8_QUANT_SECTION):
        lines = table(rows, ours, baselines, gemm_passes)
        if lines:
            out.append((title, lines))
    lines = table(rows, *MLP_SECTION[1:], passes={"forward", "forward_backward"})
    if lines:
        out.append((MLP_SECTION[0], lines))
    # The layer's rows (gmoe_linear, gmoe_linear_<recipe>) against torch's layer composition.
    fp8_layers = sorted({r["impl"] for r in rows if r["impl"].startswith(LAYER_IMPL + "_")})
    for title, ours, baselines in (LAYER_TORCH_BF16, (LAYER_TORCH_FP8_TITLE, fp8_layers, LAYER_TORCH_FP8_BASELINES)):
        if any(r["impl"] in baselines for r in rows):
            lines = table(rows, ours, baselines, passes={"forward", "forward_backward"})
            if lines:
                out.append((title, lines))
    return out


def layer_table(rows):
    """GroupedLinear rows: time, bare GEMMs of the same work, overhead, launches; geomean per pass."""
    head = ["case", "pass", f"{LAYER_IMPL} TFLOP/s", "ms", "bare GEMMs ms", "overhead", "kernels", "memsets",
            "memcpys", "correct"]
    lines, logs = [head], {}
    for r in rows:
        if r["impl"] != LAYER_IMPL:
            continue
        if r.get("skipped"):
            lines.append([r["case"], r["pass"], "skipped"] + ["-"] * 7)
            continue
        line = [r["case"], r["pass"], f"{r['tflops']:.1f}", f"{r['ms']:.3f}"]
        bare = r.get("bare_ms")
        if bare:
            line += [f"{bare:.3f}", f"{100 * (r['ms'] / bare - 1):.1f}%"]
            logs.setdefault(r["pass"], []).append(math.log(r["ms"] / bare))
        else:
            line += ["-", "-"]
        nodes = r.get("graph_nodes") or {}
        line += [str(nodes.get(k, "-")) for k in ("kernel", "memset", "memcpy")]
        line.append("-" if r.get("correct") is None else ("yes" if r["correct"] else "NO"))
        lines.append(line)
    if len(lines) == 1:
        return []
    for p, v in logs.items():
        lines.append(["geomean", p, "", "", "", f"{100 * (math.exp(sum(v) / len(v)) - 1):.1f}%", "", "", "", ""])
    return lines


def fp8_layer_table(rows, prefix=LAYER_IMPL + "_", what="bf16 layer"):
    """FP8 rows with a bf16 twin timed interleaved (impl <prefix><recipe>, e.g. gmoe_linear_<recipe>
    for GroupedLinear, gmoe_<recipe> for GroupedMLP): their bare_ms is the native (bf16) time; the
    speedup is bf16 time / FP8 time; geomean per recipe and pass. Where the row has native_alone_ms
    (the bf16 one timed in the same run but not beside the FP8 one), the speedup against it too."""
    head = ["case", "pass", "recipe", "fp8 TFLOP/s", f"{what} TFLOP/s", "fp8/bf16", "fp8/bf16 alone", "kernels",
            "correct"]
    lines, logs, alone_logs = [head], {}, {}
    for r in rows:
        if not r["impl"].startswith(prefix) or not r.get("bare_ms"):
            continue
        recipe = r["impl"][len(prefix):]
        speedup = r["bare_ms"] / r["ms"]
        alone = r["native_alone_ms"] / r["ms"] if r.get("native_alone_ms") else None
        logs.setdefault((recipe, r["pass"]), []).append(math.log(speedup))
        if alone:
            alone_logs.setdefault((recipe, r["pass"]), []).append(math.log(alone))
        nodes = r.get("graph_nodes") or {}
        lines.append([r["case"], r["pass"], recipe, f"{r['tflops']:.1f}", f"{r['tflops'] / speedup:.1f}",
                      f"{speedup:.2f}x", f"{alone:.2f}x" if alone else "-", str(nodes.get("kernel", "-")),
                      "-" if r.get("correct") is None else ("yes" if r["correct"] else "NO")])
    if len(lines) == 1:
        return []
    for (recipe, p), v in logs.items():
        a = alone_logs.get((recipe, p))
        lines.append(["geomean", p, recipe, "", "", f"{math.exp(sum(v) / len(v)):.2f}x",
                      f"{math.exp(sum(a) / len(a)):.2f}x" if a else "", "", ""])
    return lines


def activation_share_table(rows):
    """The activation kernels alone (impl gmoe_activation) as a share of GroupedMLP's time, per
    case and pass: what fusing the activation into the GEMMs' epilogues could at most save."""
    ms = {}
    for r in rows:
        if (r["impl"] in ("gmoe", "gmoe_activation") and r["pass"] in ("forward", "forward_backward")
                and not r.get("skipped")):
            ms.setdefault((r["case"], r["pass"]), {})[r["impl"]] = r["ms"]
    lines = [["case", "pass", "GroupedMLP ms", "activation ms", "share"]]
    for (case, p), v in ms.items():
        if "gmoe" in v and "gmoe_activation" in v and v["gmoe"] > 0:
            lines.append([case, p, f"{v['gmoe']:.3f}", f"{v['gmoe_activation']:.3f}",
                          f"{100 * v['gmoe_activation'] / v['gmoe']:.1f}%"])
    return lines if len(lines) > 1 else []


def print_table(lines):
    widths = [max(len(l[i]) for l in lines) for i in range(len(lines[0]))]
    for n, l in enumerate(lines):
        print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(l, widths))))
        if n == 0:
            print("-" * (sum(widths) + 2 * len(widths)))


def write_markdown_table(f, lines, labels=2):
    """A markdown table: its first `labels` columns left-aligned, the numbers right-aligned."""
    for n, l in enumerate(lines):
        f.write("| " + " | ".join(l) + " |\n")
        if n == 0:
            f.write("|" + "---|" * labels + "---:|" * (len(l) - labels) + "\n")


def is_moe(r):
    return r.get("kind") == "moe"


def moe_table(rows):
    """The MoE block forward + backward per case: gmoe (eager C++ calls), gmoe_graph (the captured
    pass replayed), gmoe_torch (the PyTorch module), the PyTorch composition eager and compiled; the
    compiled composition's time over gmoe's and gmoe_torch's (the targets: >= 1.5x, >= 1.8x on
    fine-grained cases); bytes kept for backward per token and gmoe's over the compiled composition's
    (target <= 0.6x); peak memory of each. gmoe and gmoe_torch run with the layer's defaults
    (regather_expert_input: the permuted rows gathered again in backward instead of kept);
    gmoe_keep_input and gmoe_torch_keep_input are the same layers keeping them."""
    impls = ["gmoe", "gmoe_graph", "gmoe_keep_input", "gmoe_torch", "gmoe_torch_keep_input", "torch",
             "torch_compile"]
    mem_impls = ["gmoe", "gmoe_keep_input", "gmoe_torch", "gmoe_torch_keep_input", "torch", "torch_compile"]
    cells = {}
    for r in rows:
        if is_moe(r) and r["pass"] == "forward_backward" and r["impl"] in impls:
            cells.setdefault(r["case"], {})[r["impl"]] = r
    if not cells:
        return []

    def get(c, impl, key):
        r = c.get(impl)
        return None if r is None or r.get("skipped") else r.get(key)

    def num(v, prec):
        return "-" if v is None else f"{v:.{prec}f}"

    def ratio(a, b):
        return None if a is None or b is None or b <= 0 else a / b

    head = (["case"] + [f"{i} ms" for i in impls] + ["compiled/gmoe", "compiled/gmoe_torch"]
            + [f"kept B/token {i}" for i in mem_impls]
            + ["kept gmoe/compiled"] + [f"peak MiB {i}" for i in mem_impls]
            + ["correct"])
    lines, logs = [head], {"compiled/gmoe": [], "compiled/gmoe_torch": [], "kept": []}
    for case, c in cells.items():
        speed = ratio(get(c, "torch_compile", "ms"), get(c, "gmoe", "ms"))
        speed_t = ratio(get(c, "torch_compile", "ms"), get(c, "gmoe_torch", "ms"))
        kept = ratio(get(c, "gmoe", "kept_bytes_per_token"), get(c, "torch_compile", "kept_bytes_per_token"))
        for key, v in (("compiled/gmoe", speed), ("compiled/gmoe_torch", speed_t), ("kept", kept)):
            if v:
                logs[key].append(math.log(v))
        checked = [c[i].get("correct") for i in ("gmoe", "gmoe_keep_input", "gmoe_torch", "gmoe_torch_keep_input")
                   if i in c and c[i].get("correct") is not None]
        lines.append([case] + [num(get(c, i, "ms"), 3) if i in c and not c[i].get("skipped") else
                               ("skipped" if i in c else "-") for i in impls]
                     + [num(speed, 2) + ("x" if speed else ""), num(speed_t, 2) + ("x" if speed_t else "")]
                     + [num(get(c, i, "kept_bytes_per_token"), 0) for i in mem_impls]
                     + [num(kept, 2) + ("x" if kept else "")]
                     + [num(get(c, i, "peak_mib"), 1) for i in mem_impls]
                     + ["-" if not checked else ("yes" if all(checked) else "NO")])
    geo = lambda v: f"{math.exp(sum(v) / len(v)):.2f}x" if v else "-"  # noqa: E731
    lines.append(["geomean"] + [""] * len(impls) + [geo(logs["compiled/gmoe"]), geo(logs["compiled/gmoe_torch"])]
                 + [""] * len(mem_impls) + [geo(logs["kept"])] + [""] * (len(mem_impls) + 1))
    return lines


MOE_PHASES = ("gmoe_router", "gmoe_permute", "gmoe_experts", "gmoe_combine")


def moe_breakdown_table(rows):
    """What limits the MoE block's speed-up, per case: the block (gmoe, forward + backward) and its
    phases alone from the same run (gmoe-bench --mode moe: router, permute, the experts' GroupedMLP
    on the block's rows: the GEMM floor, combine; each forward + backward), the rest (block less
    the phases: allocation, the regather, what runs between them), the experts' share of the block,
    and against the compiled composition: the speed-up reached (compiled / block) and its ceiling
    (compiled / experts alone: the speed-up if everything but the expert GEMMs took no time)."""
    cells = {}
    for r in rows:
        if is_moe(r) and r["pass"] == "forward_backward" and not r.get("skipped") and r.get("ms") is not None:
            cells.setdefault(r["case"], {})[r["impl"]] = r["ms"]
    cells = {case: c for case, c in cells.items() if "gmoe" in c and all(p in c for p in MOE_PHASES)}
    if not cells:
        return []
    fmt = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    times = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    lines = [["case", "block ms", "keep_input ms", "router", "permute", "experts", "combine", "phases sum", "rest",
              "experts share", "compiled ms", "compiled/block", "ceiling compiled/experts"]]
    logs = {"reached": [], "ceiling": []}
    for case, c in cells.items():
        block, experts, phases = c["gmoe"], c["gmoe_experts"], sum(c[p] for p in MOE_PHASES)
        compiled = c.get("torch_compile")
        reached = compiled / block if compiled and block > 0 else None
        ceiling = compiled / experts if compiled and experts > 0 else None
        for key, v in (("reached", reached), ("ceiling", ceiling)):
            if v:
                logs[key].append(math.log(v))
        lines.append([case, fmt(block), fmt(c.get("gmoe_keep_input")), fmt(c["gmoe_router"]), fmt(c["gmoe_permute"]),
                      fmt(experts), fmt(c["gmoe_combine"]), fmt(phases), fmt(block - phases),
                      f"{100 * experts / block:.0f}%" if block > 0 else "-", fmt(compiled), times(reached),
                      times(ceiling)])
    geo = lambda v: f"{math.exp(sum(v) / len(v)):.2f}x" if v else "-"  # noqa: E731
    lines.append(["geomean"] + [""] * 10 + [geo(logs["reached"]), geo(logs["ceiling"])])
    return lines


def moe_copy_table(rows):
    """Permute and combine (forward and backward) alone: bytes read + written per second against a
    plain device copy's in the same run (target: >= 80%)."""
    lines = [["case", "op", "pass", "ms", "GB/s", "copy GB/s", "of copy"]]
    for r in rows:
        if is_moe(r) and r.get("gbps") is not None and r["impl"] != "device_copy" and not r.get("skipped"):
            copy = r.get("copy_gbps")
            lines.append([r["case"], r["impl"], r["pass"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}",
                          "-" if not copy else f"{copy:.0f}", "-" if not copy else f"{100 * r['gbps'] / copy:.1f}%"])
    return lines if len(lines) > 1 else []


# gmoe-bench --mode offload's impls: the stack's step without and with offloading, and the
# offloader's copies alone beside a plain pinned copy of the same bytes.
OFFLOAD_IMPLS = ("gmoe_stack", "gmoe_stack_offload", "gmoe_stack_offload_all", "offloader", "pinned_memcpy")
# The offloaded steps: impl, and the OffloadScheduler schedule it ran. The offloader's copies are
# those of gmoe_stack_offload's bytes (every layer but the last).
OFFLOAD_SCHEDULES = (("gmoe_stack_offload", "last layer kept"), ("gmoe_stack_offload_all", "every layer"))


def is_offload(r):
    return r.get("kind") == "offload"


def is_module(r):
    return r.get("kind") == "module"


def is_train(r):
    return r.get("kind") == "train"


TRAIN_PARTS = ("step", "moe", "optimizer", "rest")


def train_table(rows):
    """The training step of examples/train_moe_lm.py split by bench/train_step_breakdown.py: per
    configuration and model the step and its parts in ms, the MoE blocks' share of the step, torch's
    time over gmoe's per part, and the Amdahl bound on the step's speed-up (everything but the MoE
    blocks equal). [] when there are no train rows."""
    cells = {}
    for r in rows:
        if is_train(r) and not r.get("skipped"):
            cells.setdefault(r["case"], {}).setdefault(r["impl"], {})[r["pass"]] = r
    out = [["configuration", "model"] + [f"{p} ms" for p in TRAIN_PARTS] + ["MoE share of the step", "tokens/s",
                                                                              "step peak MiB", "torch/gmoe step",
                                                                              "torch/gmoe MoE", "Amdahl bound"]]
    for case, impls in cells.items():
        ms = {i: {p: impls[i][p]["ms"] for p in TRAIN_PARTS if p in impls[i]} for i in impls}
        g, t = ms.get("gmoe", {}), ms.get("torch", {})
        for impl in sorted(impls):
            m = ms[impl]
            ours = impl == "gmoe" and g and t
            bound = (t["step"] / (t["step"] - t["moe"] + g["moe"])) if ours else None
            share = ratio_of(m.get("moe"), m.get("step"))
            out.append([case, impl] + [fmt(m.get(p), 2) for p in TRAIN_PARTS]
                       + [fmt(None if share is None else 100 * share, 0, "%"),
                          fmt(impls[impl].get("step", {}).get("tokens_per_s"), 0),
                          fmt(impls[impl].get("step", {}).get("peak_mib"), 0),
                          fmt(ratio_of(t.get("step"), g.get("step")) if ours else None, 2, "x"),
                          fmt(ratio_of(t.get("moe"), g.get("moe")) if ours else None, 2, "x"),
                          fmt(bound, 2, "x")])
    return out if len(out) > 1 else []


def train_config_text(c):
    """A train row's configuration (bench/train_step_breakdown.py's CONFIG_FIELDS) in words."""
    text = (f"{c['layers']} layers, hidden {c['hidden']}, {c['heads']} heads, {c['experts']} experts top-{c['top_k']}, "
            f"expert FFN {c['ffn']} {c['activation']}, batch {c['batch']} x {c['seq_len']}, {c['dtype']}")
    extra = [c.get("recipe"), "delayed wgrad" if c.get("delay_wgrad") else None, c.get("optimizer"),
             None if c.get("cuda_graph", True) else "no CUDA graph", None if c.get("compile", True) else "no compile"]
    return text + "".join(f", {e}" for e in extra if e)


def train_findings(rows):
    """Per configuration with both models: gmoe's tokens/s over the PyTorch model's (issue 44's
    target: >= 1.2x), the MoE blocks' share of each model's step and, where measured, the peaks."""
    cells = {}
    for r in rows:
        if is_train(r) and not r.get("skipped") and r["pass"] in ("step", "moe"):
            cells.setdefault(r["case"], {}).setdefault(r["impl"], {})[r["pass"]] = r
    out = []
    for case, impls in cells.items():
        g, t = impls.get("gmoe", {}), impls.get("torch", {})
        if not all(p in m for m in (g, t) for p in ("step", "moe")):
            continue
        share = {i: m["moe"]["ms"] / m["step"]["ms"] for i, m in (("gmoe", g), ("torch", t))}
        config = g["step"].get("config")
        line = (f"{case}: gmoe trains {t['step']['ms'] / g['step']['ms']:.2f}x the tokens/s of the PyTorch model "
                f"(target: >= 1.2x) at a configuration where the MoE blocks are {100 * share['gmoe']:.0f}% of the "
                f"step ({100 * share['torch']:.0f}% of the PyTorch model's)")
        if config:
            line += f": {train_config_text(config)}"
        peaks = [m["step"].get("peak_mib") for m in (g, t)]
        if None not in peaks and peaks[1] > 0:
            line += f"; peak memory {peaks[0] / peaks[1]:.2f}x the PyTorch model's"
        out.append(line + ".")
    return out


def mark_kinds(rows):
    """Files written before offload and module rows carried their kind: offload rows are known by their
    impls; the module bench's rows are those from its first gmoe_torch row (outside the moe cases) to
    its op-overhead rows, the last it writes (its gmoe, torch and torch_compile rows would otherwise
    be taken for the mlp mode's and torch_baseline.py's of the same case and pass)."""
    for r in rows:
        if not r.get("kind") and r["impl"] in OFFLOAD_IMPLS:
            r["kind"] = "offload"
    if any(is_module(r) for r in rows):
        return
    overhead = [i for i, r in enumerate(rows) if "us_per_call" in r]
    first = next((i for i, r in enumerate(rows) if r["impl"] == "gmoe_torch" and not r.get("kind")), None)
    if overhead and first is not None and first < overhead[-1]:
        for r in rows[first:overhead[-1] + 1]:
            r.setdefault("kind", "module")
    for i in overhead:
        rows[i]["kind"] = "module"


# Offload rows of files written before their numeric fields: the same numbers in the note.
OFFLOAD_NOTE_FIELDS = {"activations_mib": r"activations after forward ([0-9.]+) MiB",
                       "peak_mib": r"step peak ([0-9.]+) MiB", "offloaded_mib": r"([0-9.]+) MiB offloaded",
                       "gbps": r"([0-9.]+) GB/s"}


def offload_field(r, key):
    """An offload row's numeric field, or the same number parsed from its note (None when neither)."""
    if r is None or r.get("skipped"):
        return None
    if r.get(key) is not None:
        return r[key]
    m = re.search(OFFLOAD_NOTE_FIELDS[key], r.get("note") or "")
    return float(m.group(1)) if m else None


def fmt(v, prec, suffix=""):
    return "-" if v is None else f"{v:.{prec}f}{suffix}"


def ratio_of(a, b):
    return None if a is None or b is None or b <= 0 else a / b


def geomean_cell(logs):
    return f"{math.exp(sum(logs) / len(logs)):.2f}x" if logs else "-"


def offload_tables(rows):
    """Per case and offloading schedule (OFFLOAD_SCHEDULES): the step without and with offloading
    (ms), the copies' time (the offloader's d2h + h2d alone; for a schedule that offloads other
    bytes, at the same bandwidth), the step with over max(step without, copies) (issue 42's target:
    <= 1.1x; a geometric mean per schedule), the
    activations after forward without and with and the reduction (target: >= 70%), the steps' peaks
    and the bytes offloaded; then per case and direction the offloader's bandwidth against the plain
    pinned copy's (target: >= 85%). Returns (step table, copy table), each [] when empty."""
    cells = {}
    for r in rows:
        if is_offload(r):
            cells.setdefault(r["case"], {})[(r["pass"], r["impl"])] = r
    ms = lambda r: None if r is None or r.get("skipped") else r.get("ms")  # noqa: E731
    step = [["case", "schedule", "step ms without", "step ms with", "copies ms", "with/max(without, copies)",
             "activations MiB without", "activations MiB with", "activations less", "peak MiB without",
             "peak MiB with", "offloaded MiB", "correct"]]
    logs = {schedule: [] for _, schedule in OFFLOAD_SCHEDULES}
    for case, c in cells.items():
        plain = c.get(("step", "gmoe_stack"))
        d2h, h2d = ms(c.get(("copy_d2h", "offloader"))), ms(c.get(("copy_h2d", "offloader")))
        measured = None if d2h is None or h2d is None else d2h + h2d
        measured_mib = offload_field(c.get(("step", OFFLOAD_SCHEDULES[0][0])), "offloaded_mib")
        for impl, schedule in OFFLOAD_SCHEDULES:
            off = c.get(("step", impl))
            if off is None and (impl != OFFLOAD_SCHEDULES[0][0] or plain is None):
                continue
            if off is not None and off.get("skipped"):
                step.append([case, schedule, fmt(ms(plain), 3), "skipped"] + ["-"] * 9)
                continue
            # The copies were timed for the first schedule's bytes; another schedule's at their bandwidth.
            mib = offload_field(off, "offloaded_mib")
            copies = measured if impl == OFFLOAD_SCHEDULES[0][0] else \
                (None if None in (measured, mib) or not measured_mib else measured * mib / measured_mib)
            slow = ratio_of(ms(off), None if ms(plain) is None or copies is None else max(ms(plain), copies))
            if slow:
                logs[schedule].append(math.log(slow))
            held = [offload_field(plain, "activations_mib"), offload_field(off, "activations_mib")]
            less = ratio_of(None if None in held else held[0] - held[1], held[0])
            checked = [r["correct"] for r in (plain, off) if r is not None and r.get("correct") is not None]
            step.append([case, schedule, fmt(ms(plain), 3), fmt(ms(off), 3), fmt(copies, 3), fmt(slow, 2, "x"),
                         fmt(held[0], 1), fmt(held[1], 1), fmt(None if less is None else 100 * less, 1, "%"),
                         fmt(offload_field(plain, "peak_mib"), 1), fmt(offload_field(off, "peak_mib"), 1),
                         fmt(mib, 1), "-" if not checked else ("yes" if all(checked) else "NO")])
    for schedule, sched_logs in logs.items():
        if sched_logs or schedule == OFFLOAD_SCHEDULES[0][1]:
            step.append(["geomean", schedule, "", "", "", geomean_cell(sched_logs)] + [""] * 7)
    copy = [["case", "direction", "offloader ms", "offloader GB/s", "pinned copy ms", "pinned copy GB/s",
             "of pinned copy"]]
    for case, c in cells.items():
        for direction in ("copy_d2h", "copy_h2d"):
            off, plain = c.get((direction, "offloader")), c.get((direction, "pinned_memcpy"))
            if off is None or off.get("skipped"):
                continue
            share = ratio_of(ms(plain), ms(off))  # the same bytes: the time ratio is the bandwidth ratio
            copy.append([case, direction, fmt(ms(off), 3), fmt(offload_field(off, "gbps"), 1), fmt(ms(plain), 3),
                         fmt(offload_field(plain, "gbps"), 1), fmt(None if share is None else 100 * share, 1, "%")])
    return (step if len(step) > 2 else []), (copy if len(copy) > 1 else [])


def module_tables(rows):
    """The PyTorch package (bench/torch_module_bench.py, one session): per mlp case and pass the module
    (gmoe_torch) against the C++ GroupedMLP (gmoe; issue 38's target: within 3%, a time ratio
    <= 1.03) and against the torch composition eager and compiled (their time over the module's);
    then per overhead case the per-call host overhead of tiny gmoe ops or modules against torch doing
    the same. Returns (time table, overhead table), each [] when empty."""
    cells, overhead = {}, {}
    for r in rows:
        if not is_module(r):
            continue
        if "us_per_call" in r:
            overhead.setdefault(r["case"], {})[r["impl"]] = r["us_per_call"]
        else:
            cells.setdefault((r["case"], r["pass"]), {})[r["impl"]] = r
    ms = lambda c, i: None if i not in c or c[i].get("skipped") else c[i].get("ms")  # noqa: E731
    cols = ["gmoe_torch/gmoe", "torch/gmoe_torch", "torch_compile/gmoe_torch"]
    times = [["case", "pass", "gmoe_torch ms", "gmoe ms", "torch ms", "torch_compile ms"] + cols + ["correct"]]
    logs = {k: [] for k in cols}
    for (case, p), c in cells.items():
        if "gmoe_torch" not in c:
            continue
        ratios = [ratio_of(ms(c, "gmoe_torch"), ms(c, "gmoe")), ratio_of(ms(c, "torch"), ms(c, "gmoe_torch")),
                  ratio_of(ms(c, "torch_compile"), ms(c, "gmoe_torch"))]
        for k, v in zip(cols, ratios):
            if v:
                logs[k].append(math.log(v))
        correct = c["gmoe_torch"].get("correct")
        times.append([case, p] + [fmt(ms(c, i), 3) for i in ("gmoe_torch", "gmoe", "torch", "torch_compile")]
                     + [fmt(ratios[0], 3), fmt(ratios[1], 2, "x"), fmt(ratios[2], 2, "x")]
                     + ["-" if correct is None else ("yes" if correct else "NO")])
    times.append(["geomean", "", "", "", "", "", f"{math.exp(sum(logs[cols[0]]) / len(logs[cols[0]])):.3f}"
                  if logs[cols[0]] else "-", geomean_cell(logs[cols[1]]), geomean_cell(logs[cols[2]]), ""])
    ops = [["overhead case", "gmoe us/call", "torch us/call", "gmoe/torch", "gmoe - torch us"]]
    for case, by_impl in overhead.items():
        ours, theirs = by_impl.get("gmoe_op_overhead"), by_impl.get("torch_op_overhead")
        ops.append([case, fmt(ours, 1), fmt(theirs, 1), fmt(ratio_of(ours, theirs), 2, "x"),
                    fmt(None if ours is None or theirs is None else ours - theirs, 1)])
    return (times if len(times) > 2 else []), (ops if overhead else [])


def is_ep(r):
    return r.get("kind") == "ep"


def ep_tables(rows):
    """bench/torch_ep_baseline.py's rows (kind "ep", one run on the GPUs of one host): per case the
    EP MoE layer, gmoe_ep (gmoe.MoELayer with an EP group) against torch_ep (the PyTorch composition
    with all_to_all_single and host split sizes), forward and forward + backward in ms and torch_ep's
    time over gmoe_ep's (issue 43's target: >= 1.3x forward + backward), with the peak memory of each;
    then per case and op the dispatch and combine alone, gmoe_ep's and the composition's exchanges,
    against NCCL's all-to-all of the same bytes (target: gmoe_ep >= 80%). Returns (layer table,
    communication table), each [] when empty."""
    cells = {}
    for r in rows:
        if is_ep(r):
            cells.setdefault(r["case"], {})[(r["impl"], r["pass"])] = r

    def get(c, impl, p, key="ms"):
        r = c.get((impl, p))
        return None if r is None or r.get("skipped") else r.get(key)

    def checked(c, keys):
        v = [c[k].get("correct") for k in keys if k in c and c[k].get("correct") is not None]
        return "-" if not v else ("yes" if all(v) else "NO")

    layer = [["case", "EP", "gmoe_ep fwd ms", "torch_ep fwd ms", "torch_ep/gmoe_ep fwd", "gmoe_ep fwd+bwd ms",
              "torch_ep fwd+bwd ms", "torch_ep/gmoe_ep fwd+bwd", "peak MiB gmoe_ep", "peak MiB torch_ep", "correct"]]
    comm = [["case", "op", "MiB/rank", "nccl_a2a GB/s", "gmoe_ep ms", "gmoe_ep GB/s", "gmoe_ep/nccl", "torch_ep ms",
             "torch_ep GB/s", "torch_ep/nccl", "correct"]]
    logs = {"fwd": [], "fb": [], "dispatch": [], "combine": []}
    for case, c in cells.items():
        ep = next((r.get("ep_size") for r in c.values() if r.get("ep_size")), None)
        fwd = ratio_of(get(c, "torch_ep", "forward"), get(c, "gmoe_ep", "forward"))
        fb = ratio_of(get(c, "torch_ep", "forward_backward"), get(c, "gmoe_ep", "forward_backward"))
        if any(get(c, i, p) is not None for i in ("torch_ep", "gmoe_ep") for p in ("forward", "forward_backward")):
            layer.append([case, fmt(ep, 0), fmt(get(c, "gmoe_ep", "forward"), 3), fmt(get(c, "torch_ep", "forward"), 3),
                          fmt(fwd, 2, "x"), fmt(get(c, "gmoe_ep", "forward_backward"), 3),
                          fmt(get(c, "torch_ep", "forward_backward"), 3), fmt(fb, 2, "x"),
                          fmt(get(c, "gmoe_ep", "forward_backward", "peak_mib"), 1),
                          fmt(get(c, "torch_ep", "forward_backward", "peak_mib"), 1),
                          checked(c, [("gmoe_ep", "forward"), ("gmoe_ep", "forward_backward")])])
        nccl = get(c, "nccl_a2a", "all_to_all", "gbps")
        shares = {op: ratio_of(get(c, "gmoe_ep", op, "gbps"), nccl) for op in ("dispatch", "combine")}
        for key, v in (("fwd", fwd), ("fb", fb), *shares.items()):
            if v:
                logs[key].append(math.log(v))
        nbytes = next((r.get("bytes") for r in c.values() if r.get("bytes")), None)
        for op in ("dispatch", "combine"):
            if get(c, "gmoe_ep", op) is None and get(c, "torch_ep", op) is None:
                continue
            theirs = ratio_of(get(c, "torch_ep", op, "gbps"), nccl)
            comm.append([case, op, fmt(None if nbytes is None else nbytes / 2 ** 20, 1), fmt(nccl, 0),
                         fmt(get(c, "gmoe_ep", op), 3), fmt(get(c, "gmoe_ep", op, "gbps"), 0),
                         fmt(None if shares[op] is None else 100 * shares[op], 1, "%"), fmt(get(c, "torch_ep", op), 3),
                         fmt(get(c, "torch_ep", op, "gbps"), 0), fmt(None if theirs is None else 100 * theirs, 1, "%"),
                         checked(c, [("gmoe_ep", op)])])
    pct = lambda v: f"{100 * math.exp(sum(v) / len(v)):.1f}%" if v else "-"  # noqa: E731
    layer.append(["geomean", "", "", "", geomean_cell(logs["fwd"]), "", "", geomean_cell(logs["fb"]), "", "", ""])
    comm.append(["geomean dispatch", "", "", "", "", "", pct(logs["dispatch"]), "", "", "", ""])
    comm.append(["geomean combine", "", "", "", "", "", pct(logs["combine"]), "", "", "", ""])
    return (layer if len(layer) > 2 else []), (comm if len(comm) > 3 else [])


EP_OVERLAP_PASSES = ("forward_eager", "backward_sequential", "backward_overlap", "exchanges", "exchanges_dispatch",
                     "exchanges_combine", "wgrad")


def ep_overlap_table(rows):
    """tools/gmoe_ep_bench.cpp's rows (kind "ep", impl gmoe_ep, and gmoe_ep_trimmed with
    --trim-pool-each-step): per case and pool mode the C++ MoELayer's backward in order and with its
    exchanges overlapped with the experts' delayed weight gradients, the time saved, the exchanges
    against dispatch + combine alone, and whether the overlapped gradients equal the sequential
    ones. [] when there are none."""
    cells = {}
    for r in rows:
        if is_ep(r) and r["impl"] in ("gmoe_ep", "gmoe_ep_trimmed") and r["pass"] in EP_OVERLAP_PASSES:
            cells.setdefault((r["case"], r["impl"]), {})[r["pass"]] = r
    out = [["case", "pool", "fwd ms", "seq ms", "ovl ms", "saved ms", "exch ms", "disp+comb ms", "wgrad ms",
            "correct"]]
    for (case, impl), c in cells.items():
        ms = {p: (None if c.get(p) is None or c[p].get("skipped") else c[p].get("ms")) for p in EP_OVERLAP_PASSES}
        saved = None if ms["backward_sequential"] is None or ms["backward_overlap"] is None else \
            ms["backward_sequential"] - ms["backward_overlap"]
        parts = None if ms["exchanges_dispatch"] is None or ms["exchanges_combine"] is None else \
            ms["exchanges_dispatch"] + ms["exchanges_combine"]
        ok = (c.get("backward_overlap") or {}).get("correct")
        out.append([case, "trimmed each step" if impl == "gmoe_ep_trimmed" else "cached",
                    *(fmt(ms[p], 3) for p in ("forward_eager", "backward_sequential", "backward_overlap")),
                    fmt(saved, 3), fmt(ms["exchanges"], 3), fmt(parts, 3), fmt(ms["wgrad"], 3),
                    "-" if ok is None else ("yes" if ok else "NO")])
    return out if len(out) > 1 else []


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
        for n in d.get("notes", []):
            if n not in merged.setdefault("notes", []):
                merged["notes"].append(n)
        mark_kinds(d["rows"])
        merged["rows"] += d["rows"]
        for e in d.get("errors", []):
            # An error of one (case, pass, impl) is that row not run: a skipped row (docs/benchmarks.md).
            if e.get("case") and e.get("pass") and e.get("impl"):
                merged["rows"].append(skipped_row(e))
            else:
                merged.setdefault("errors", []).append(e)
    if merged is None:
        raise SystemExit("report: no readable input")
    json.dump(merged, open(args.out, "w"), indent=1)
    # The moe cases', offload and module rows have tables of their own.
    rows = [r for r in merged["rows"] if not (is_moe(r) or is_offload(r) or is_module(r) or is_train(r)
                                            or is_ep(r))]
    tables = sections(rows)
    layer = layer_table(rows)
    fp8_layer = fp8_layer_table(rows)
    fp8_mlp = fp8_layer_table([r for r in rows if r["pass"] in ("forward", "forward_backward")
                               and not r["impl"].startswith(LAYER_IMPL)], "gmoe_", "bf16 GroupedMLP")
    fp8_gemm = fp8_layer_table([r for r in rows if r["pass"] in ("fprop", "dgrad", "wgrad")], "gmoe_",
                               "bf16 GEMM")
    act_share = activation_share_table(rows)
    moe = moe_table(merged["rows"])
    moe_passes = table([r for r in merged["rows"] if is_moe(r)], ["gmoe", "gmoe_graph", "gmoe_torch"],
                       ["torch", "torch_compile"], passes={"forward", "backward", "forward_backward"})
    moe_copy = moe_copy_table(merged["rows"])
    moe_breakdown = moe_breakdown_table(merged["rows"])
    offload_step, offload_copy = offload_tables(merged["rows"])
    module_times, module_ops = module_tables(merged["rows"])
    train, findings = train_table(merged["rows"]), train_findings(merged["rows"])
    ep_layer, ep_comm = ep_tables(merged["rows"])
    ep_overlap = ep_overlap_table(merged["rows"])
    notes = merged.get("notes") or []
    for title, lines in tables:
        print(f"\n{title}:")
        print_table(lines)
    if layer:
        print("\nGroupedLinear (grouped bias, f32 main_grad accumulated) vs its bare GEMMs, same run:")
        print_table(layer)
    if fp8_layer:
        print("\nGroupedLinear with FP8 recipes vs the bf16 layer (interleaved; weights quantized every forward):")
        print_table(fp8_layer)
    if fp8_mlp:
        print("\nGroupedMLP with FP8 recipes vs the bf16 GroupedMLP (interleaved; weights quantized every forward):")
        print_table(fp8_mlp)
    if fp8_gemm:
        print("\nFP8 grouped GEMMs vs the bf16 grouped GEMM of the same pass (interleaved):")
        print_table(fp8_gemm)
    if act_share:
        print("\nThe activation kernels alone, as a share of GroupedMLP's time:")
        print_table(act_share)
    if moe:
        print("\nMoE block forward+backward (router, permute, experts, combine), same run:")
        print_table(moe)
    if moe_breakdown:
        print("\nMoE block forward+backward and its phases alone (ms), the speed-up over the compiled "
              "composition and its ceiling (compiled / experts alone):")
        print_table(moe_breakdown)
    if moe_passes:
        print("\nMoE block per pass (TFLOP/s of the expert GEMMs):")
        print_table(moe_passes)
    if moe_copy:
        print("\nPermute and combine alone against a device copy:")
        print_table(moe_copy)
    if offload_step:
        print("\nActivation offloading: one step of the stack without and with (ms, MiB):")
        print_table(offload_step)
    if offload_copy:
        print("\nThe offloader's copies alone against a plain pinned copy:")
        print_table(offload_copy)
    if module_times:
        print("\nPyTorch package: gmoe.GroupedMLP (gmoe_torch) against the C++ layer and the torch composition (ms):")
        print_table(module_times)
    if module_ops:
        print("\nPer-call host overhead of ops and modules at tiny shapes, gmoe's against torch's (us):")
        print_table(module_ops)
    if train:
        print("\nTraining step of examples/train_moe_lm.py, split (ms):")
        print_table(train)
        for line in findings:
            print(line)
    if ep_layer:
        print("\nExpert parallelism: the EP MoE layer, gmoe_ep against the torch all_to_all_single composition (ms):")
        print_table(ep_layer)
    if ep_comm:
        print("\nExpert parallelism: dispatch and combine alone against NCCL's all-to-all of the same bytes:")
        print_table(ep_comm)
    if ep_overlap:
        print("\nExpert parallelism: the C++ MoELayer's backward in order and overlapped (gmoe-ep-bench, ms):")
        print_table(ep_overlap)
    for n in notes:
        print(f"note: {n}")
    skipped = skipped_lines(merged["rows"])
    if skipped:
        print("\nSkipped (not run):")
        for line in skipped:
            print(f"  {line}")
    for e in merged.get("errors", []):
        print(f"error: {e.get('impl')} {e.get('case')} {e.get('pass', '')}: {e.get('error', '')[:300]}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# gmoe benchmark: suite {merged.get('suite')} on {merged.get('gpu')}\n\n")
            f.write(f"commit {merged.get('commit')}, {merged.get('date')}, torch {merged.get('torch')}. "
                    "TFLOP/s unless a table says otherwise (median of CUDA-event timings); every baseline measured "
                    "in the same run.\n\n")
            for title, lines in tables:
                f.write(f"\n## {title}\n\n")
                write_markdown_table(f, lines)
            if layer:
                f.write("\nGroupedLinear (grouped bias, f32 main_grad accumulated): its time beside the bare GEMMs "
                        "of the same work in the same run, the overhead, and the kernel launches per call (CUDA "
                        "graph capture).\n\n")
                write_markdown_table(f, layer)
            if fp8_layer:
                f.write("\nGroupedLinear with FP8 recipes (quantization of x, dy and the weights inside, weights "
                        "quantized in every forward, or once with '+cached_weights') against the bf16 layer timed "
                        "interleaved with it, and "
                        "against the bf16 layer timed alone in the same run (at a power cap the interleaved "
                        "pair shares the clocks the limiter sets).\n\n")
                write_markdown_table(f, fp8_layer)
            if fp8_mlp:
                f.write("\nGroupedMLP with FP8 recipes on both FCs (weights quantized in every forward, or once with "
                        "'+cached_weights') against the "
                        "bf16 GroupedMLP timed interleaved with it, and against it timed beside the unfused one in "
                        "the same run.\n\n")
                write_markdown_table(f, fp8_mlp)
            if fp8_gemm:
                f.write("\nFP8 grouped GEMMs (alone, and with the quantization of the pass's activations) against "
                        "gmoe's bf16 grouped GEMM of the same pass, inputs and output dtype, timed interleaved "
                        "with them (the column 'alone' is empty here).\n\n")
                write_markdown_table(f, fp8_gemm)
            if act_share:
                f.write("\nThe activation kernels alone (forward; forward and backward) as a share of GroupedMLP's "
                        "time: the most that fusing them into the GEMMs' epilogues could save.\n\n")
                write_markdown_table(f, act_share)
            if moe:
                f.write("\n## MoE block\n\nForward + backward of the whole block (router top-k, permute, expert MLP, "
                        "combine): gmoe (MoELayer, eager calls; gmoe_graph: the captured pass replayed; gmoe_torch: "
                        "gmoe.MoELayer) against the PyTorch composition (bench/torch_moe_baseline.py) eager and "
                        "compiled, in ms; compiled/gmoe is the speed-up (targets: >= 1.5x, >= 1.8x fine-grained). "
                        "Bytes kept for backward per token (target: gmoe <= 0.6x the compiled composition's) and "
                        "peak memory of one forward + backward beyond inputs and weights (docs/benchmarks.md).\n\n")
                write_markdown_table(f, moe, labels=1)
            if moe_breakdown:
                f.write("\nWhat limits the speed-up: the block's forward + backward (gmoe) beside its phases timed "
                        "alone in the same run (router top-k; permute; the experts' GroupedMLP on the block's rows, "
                        "the GEMM floor; combine; each forward + backward), in ms; rest = block less the phases; "
                        "ceiling = the compiled composition's time over the experts' alone, the speed-up if "
                        "everything but the expert GEMMs took no time. keep_input: the layer keeping its permuted "
                        "rows (regather_expert_input off).\n\n")
                write_markdown_table(f, moe_breakdown, labels=1)
            if moe_passes:
                f.write("\nMoE block per pass, TFLOP/s of the expert GEMMs.\n\n")
                write_markdown_table(f, moe_passes)
            if moe_copy:
                f.write("\nPermute and combine alone: bytes read + written per second against a plain device copy in "
                        "the same run (target: >= 80%).\n\n")
                write_markdown_table(f, moe_copy, labels=3)
            if offload_step or offload_copy:
                f.write("\n## Activation offloading\n\ngmoe-bench --mode offload: one training step of a stack of "
                        "GroupedMLPs on an mlp case (forward of every layer, backward in reverse) without and with "
                        "activation offloading (OffloadScheduler, one layer reloaded ahead; schedule: the last layer "
                        "kept on the device, or every layer offloaded), in ms; copies: the offloader's copies of one "
                        "step's saved tensors of every layer but the last alone, out and back (for every layer: "
                        "scaled to its bytes at the same bandwidth). "
                        "Targets (issue 42): the step with offloading at most 1.1x max(step without, copies); "
                        "the activations held after forward at least 70% less; peaks beyond inputs and weights; "
                        "correct: dx of each offloaded step bitwise equal to the step's without.\n\n")
                if offload_step:
                    write_markdown_table(f, offload_step, labels=2)
            if offload_copy:
                f.write("\nThe offloader's copies alone against one plain cudaMemcpyAsync of the same bytes between "
                        "device memory and pinned host memory, same run (target: at least 85%).\n\n")
                write_markdown_table(f, offload_copy, labels=2)
            if module_times or module_ops:
                f.write("\n## PyTorch package\n\nbench/torch_module_bench.py, one session: gmoe.GroupedMLP "
                        "(gmoe_torch, through torch.ops.gmoe) against the C++ GroupedMLP on the same case (gmoe; "
                        "target, issue 38: gmoe_torch/gmoe at most 1.03) and against the torch composition "
                        "_grouped_mm -> activation -> _grouped_mm eager and compiled (their time over the "
                        "module's), in ms; correct: the module against the composition.\n\n")
                write_markdown_table(f, module_times)
            if module_ops:
                f.write("\nHost time per call at tiny shapes (8 experts, 64 rows, width 64), called back to "
                        "back, gmoe against torch doing the same: op_overhead grouped_bias_grad against sum over "
                        "dim 0; grouped_gemm grouped_gemm_fprop against _grouped_mm, without and with (_ag) "
                        "autograd recording; mlp_forward and mlp_fwd_bwd gmoe.GroupedMLP against the torch "
                        "composition (bench/torch_module_bench.py's docstring).\n\n")
                write_markdown_table(f, module_ops, labels=1)
            if train:
                f.write("\n## Training step\n\nbench/train_step_breakdown.py: the training step of "
                        "examples/train_moe_lm.py (both models, the example's CUDA graph and torch.compile) and its "
                        "parts timed alone: the MoE blocks' forward + backward on the hidden states of a step, "
                        "the optimizer (gradients to the float32 masters, clipping, AdamW, masters back), and the "
                        "rest (step - MoE - optimizer: attention, norms, head). Amdahl bound: the step's speed-up "
                        "if everything but the MoE blocks took torch's time (issue 44's target: >= 1.2x).\n\n")
                write_markdown_table(f, train)
                if findings:
                    f.write("\n" + "\n".join(f"- {line}" for line in findings) + "\n")
            if ep_layer or ep_comm:
                f.write("\n## Expert parallelism\n\nbench/torch_ep_baseline.py, one process per GPU of one host "
                        "(NVLink multicast off): the EP MoE layer (router top-k, dispatch, expert SwiGLU MLP, combine; "
                        "tokens per rank) through gmoe.MoELayer with an EP group (gmoe_ep) against the PyTorch "
                        "composition with all_to_all_single and split sizes read on the host (torch_ep, Megatron's "
                        "alltoall dispatcher without DeepEP, eager), in ms (the slowest rank's median); "
                        "torch_ep/gmoe_ep is the speed-up (issue 43's target: >= 1.3x forward + backward); peak "
                        "memory of one forward + backward beyond inputs and weights; correct: gmoe_ep's out and dx "
                        "against the composition's.\n\n")
                if ep_layer:
                    write_markdown_table(f, ep_layer, labels=1)
            if ep_comm:
                f.write("\nDispatch and combine alone (gmoe.ep_dispatch / ep_combine of a rank's T·k rows; torch_ep: "
                        "the composition's exchanges with the host sync and the regrouping) against NCCL's "
                        "all_to_all_single with equal splits of the same bytes per rank, measured in the same run; "
                        "GB/s: bytes a rank sends / time (target: gmoe_ep >= 80%). correct: the dispatched rows "
                        "bitwise the composition's, and combine(dispatch(x)) bitwise x.\n\n")
                write_markdown_table(f, ep_comm, labels=2)
            if ep_overlap:
                f.write("\n## Expert parallelism: backward overlap (C++)\n\ngmoe-ep-bench, one process per GPU: the C++ "
                        "MoELayer with an EP group; the largest of the ranks' medians (each row's note has the "
                        "smallest, the barrier, the host enqueue time, host-late steps and pool growth). fwd: the "
                        "eager forward; seq: backward then the experts' backward_dw on one stream; ovl: backward "
                        "with MoEBackwardOverlap (exchanges on a second stream, backward_dw during the combine); "
                        "saved = seq - ovl; exch: backward's dispatch + combine alone, against the two timed alone "
                        "(disp+comb); wgrad: backward_dw alone. pool: gmoe's memory pool keeping freed memory "
                        "(cached), or trimmed after every step (--trim-pool-each-step: what a pool that releases "
                        "at every sync costs). correct: the overlapped backward's dx, dlogits and weight gradients "
                        "bitwise the sequential one's on every rank.\n\n")
                write_markdown_table(f, ep_overlap, labels=2)
            for n in notes:
                f.write(f"\nNote: {n}\n")
            if skipped:
                f.write("\nSkipped (not run):\n\n")
                for line in skipped:
                    f.write(f"- {line}\n")
            if merged.get("errors"):
                f.write("\nErrors:\n\n")
                for e in merged["errors"]:
                    f.write(f"- {e.get('impl')} {e.get('case')} {e.get('pass', '')}: "
                            f"{e.get('error', '')[:300]}\n")


if __name__ == "__main__":
    main()

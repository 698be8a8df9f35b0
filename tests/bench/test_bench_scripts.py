#!/usr/bin/env python3
"""tests/bench/test_bench_scripts.py — the GPU session's Python tools, checked where there is no GPU.

bench/torch_baseline.py, bench/torch_moe_baseline.py and bench/report.py run only on the GPU
machine, where a mistake costs a device call. Here: torch_baseline.py's --dry-run on every --kind
(no torch needed: it lists the cases and what it would time) and its argument checks; the same for
torch_moe_baseline.py on the moe cases; report.py on synthetic result files of every kind of row it
tables (bf16 and FP8 GEMMs, the layer against its bare GEMMs, the FP8 layer against the bf16 one,
the layer against torch's layer composition, the MLP, the MoE block and its routing ops, activation
offloading, the PyTorch package's module bench), the ratios and geometric means it prints, torch's
per-row errors as skipped rows, and its refusal of unreadable input.

    python3 tests/bench/test_bench_scripts.py        (ctest: bench_scripts)
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.environ.get("GMOE_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SUITE = os.path.join(ROOT, "bench", "suites", "public.json")
BASELINE = os.path.join(ROOT, "bench", "torch_baseline.py")
REPORT = os.path.join(ROOT, "bench", "report.py")
MOE_BASELINE = os.path.join(ROOT, "bench", "torch_moe_baseline.py")
EP_BASELINE = os.path.join(ROOT, "bench", "torch_ep_baseline.py")
EP_SUITE = os.path.join(ROOT, "bench", "suites", "ep.json")


def run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT)


class TorchBaselineDryRun(unittest.TestCase):
    def setUp(self):
        with open(SUITE) as f:
            cases = json.load(f)["cases"]
        self.gemm = [c["name"] for c in cases if c["kind"] == "gemm"]
        self.mlp = [c["name"] for c in cases if c["kind"] == "mlp"]
        self.assertTrue(self.gemm and self.mlp, "the public suite has gemm and mlp cases")

    def dry_run(self, *extra):
        p = run(BASELINE, "--suite", SUITE, "--dry-run", *extra)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout.splitlines()

    def test_every_kind_lists_its_cases(self):
        for kind, names in (("gemm", self.gemm), ("mlp", self.mlp), ("layer", self.gemm),
                            ("all", self.gemm + self.mlp)):
            with self.subTest(kind=kind):
                lines = self.dry_run("--kind", kind)
                self.assertEqual(lines[-1], f"{len(names)} cases")
                self.assertEqual([l.split()[0] for l in lines[:-1]], names)

    def test_what_each_kind_times(self):
        gemm_line = self.dry_run("--kind", "gemm", "--case", self.gemm[0])[0]
        self.assertIn("fprop, dgrad, wgrad", gemm_line)
        self.assertNotIn("layer", gemm_line)
        layer_line = self.dry_run("--kind", "layer", "--case", self.gemm[0])[0]
        self.assertIn("layer forward, forward_backward (torch_linear, fp8 rowwise)", layer_line)
        self.assertNotIn("fprop", layer_line)
        self.assertNotIn("fp8", self.dry_run("--kind", "layer", "--no-fp8", "--case", self.gemm[0])[0])
        all_line = self.dry_run("--kind", "all", "--case", self.gemm[0])[0]
        self.assertIn("fprop, dgrad, wgrad", all_line)
        self.assertIn("layer forward", all_line)
        self.assertIn("torch_compile", self.dry_run("--kind", "mlp", "--case", self.mlp[0])[0])

    def test_case_filter(self):
        lines = self.dry_run("--kind", "all", "--case", "dsv3")
        self.assertEqual(lines[-1], f"{sum('dsv3' in n for n in self.gemm + self.mlp)} cases")

    def test_bad_arguments(self):
        for args in (("--kind", "conv"), ("--iters", "0"), ()):  # () : no --json without --dry-run
            with self.subTest(args=args):
                p = run(BASELINE, "--suite", SUITE, *args)
                self.assertNotEqual(p.returncode, 0)
                self.assertIn("error", p.stderr)


class TorchMoeBaselineDryRun(unittest.TestCase):
    def test_it_lists_the_moe_cases(self):
        with open(SUITE) as f:
            moe = [c["name"] for c in json.load(f)["cases"] if c["kind"] == "moe"]
        # issue 45's shapes, each with uniform and skewed routing
        for model in ("qwen3_30b_a3b", "dsv3_e256", "gptoss_20b", "mixtral_8x7b"):
            for routing in ("uniform", "skewed"):
                self.assertIn(f"moe_{model}/{routing}", moe)
        p = run(MOE_BASELINE, "--suite", SUITE, "--dry-run")
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        self.assertEqual(lines[-1], f"{len(moe)} cases")
        self.assertEqual([l.split()[0] for l in lines[:-1]], moe)
        self.assertIn("tokens 8192, top-8 of E 128, hidden 2048, ffn 768", p.stdout)
        p = run(MOE_BASELINE, "--suite", SUITE, "--dry-run", "--case", "gptoss")
        self.assertEqual(p.stdout.splitlines()[-1], "2 cases")
        self.assertIn("clamped_swiglu", p.stdout)

    def test_bad_arguments(self):
        for args in (("--device", "tpu"), ("--iters", "0"), ()):  # () : no --json without --dry-run
            with self.subTest(args=args):
                p = run(MOE_BASELINE, "--suite", SUITE, *args)
                self.assertNotEqual(p.returncode, 0)
                self.assertIn("error", p.stderr)


class TorchEpBaselineDryRun(unittest.TestCase):
    def test_it_lists_the_ep_cases(self):
        p = run(EP_BASELINE, "--dry-run")  # the default suite: bench/suites/ep.json
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        self.assertEqual(lines[-1], "4 cases on 2 ranks")
        self.assertEqual([l.split()[0] for l in lines[:-1]],
                         [f"ep_{m}/{r}" for m in ("dsv3_e256", "qwen3_30b_a3b") for r in ("uniform", "skewed")])
        # issue 43's shapes: DeepSeek-V3 (E 256, k 8, H 7168, F 2048) and Qwen3-30B-A3B; tokens per rank
        self.assertIn("4096 tokens/rank, top-8 of E 256 (128 per rank on 2), hidden 7168, ffn 2048", lines[0])
        self.assertIn("8192 tokens/rank, top-8 of E 128 (64 per rank on 2), hidden 2048, ffn 768", lines[2])
        # the dispatch of a rank: T·k·H bf16 = 4096·8·7168·2 bytes = 448 MiB
        self.assertIn("dispatch 448.0 MiB/rank", lines[0])
        with open(EP_SUITE) as f:
            skewed = {c["name"]: c for c in json.load(f)["cases"]}["ep_dsv3_e256/skewed"]
        with open(SUITE) as f:
            public = {c["name"]: c for c in json.load(f)["cases"]}["moe_dsv3_e256/skewed"]
        self.assertEqual(skewed["logit_bias"], public["logit_bias"])  # the public suite's skew

    def test_world_and_skipped_cases(self):
        p = run(EP_BASELINE, "--suite", os.path.join(ROOT, "tests", "bench", "ep_suite.json"), "--dry-run",
                "--world", "4", "--case", "/uniform")
        self.assertEqual(p.returncode, 0, p.stderr)
        lines = p.stdout.splitlines()
        self.assertEqual(lines[-1], "2 cases on 4 ranks")
        self.assertIn("(2 per rank on 4)", lines[0])
        self.assertIn("skipped: E = 5 is not a multiple of the EP size 4", lines[1])

    def test_bad_arguments(self):
        for args in (("--device", "tpu"), ("--iters", "0"), ("--world", "1"), ()):  # (): no --json
            with self.subTest(args=args):
                p = run(EP_BASELINE, *args)
                self.assertNotEqual(p.returncode, 0)
                self.assertIn("error", p.stderr)


def gemm_row(case, pass_name, impl, tflops, **extra):
    r = {"case": case, "pass": pass_name, "impl": impl, "dtype": "bf16", "ms": 100.0 / tflops, "tflops": tflops,
         "correct": True}
    r.update(extra)
    return r


def ms_row(case, pass_name, impl, ms, tflops=0.0, **extra):
    r = {"case": case, "pass": pass_name, "impl": impl, "dtype": "bf16", "ms": ms, "tflops": tflops, "correct": None}
    r.update(extra)
    return r


class Report(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def write(self, name, rows, **top):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            json.dump(dict(top, rows=rows), f)
        return path

    def report(self, *inputs):
        out = os.path.join(self.dir.name, "results.json")
        md = os.path.join(self.dir.name, "results.md")
        p = run(REPORT, *inputs, "--out", out, "--markdown", md)
        self.assertEqual(p.returncode, 0, p.stderr + p.stdout)
        with open(out) as f, open(md) as g:
            return p.stdout, json.load(f), g.read()

    def test_every_table(self):
        ours = [
            gemm_row("a/uniform", "fprop", "gmoe", 800.0),
            gemm_row("a/uniform", "fprop", "gmoe_fp8_blockwise", 1200.0, dtype="fp8", bare_ms=1.45 * 100.0 / 1200.0),
            gemm_row("a/uniform", "fprop", "gmoe_fp8_blockwise_with_quant", 1000.0, dtype="fp8",
                     bare_ms=1.45 * 100.0 / 1200.0),
            gemm_row("b/uniform", "fprop", "gmoe", 600.0),
            gemm_row("a/uniform", "forward_backward", "gmoe_linear", 700.0, bare_ms=100.0 / 700.0 / 1.05,
                     graph_nodes={"kernel": 12, "memset": 0, "memcpy": 0}),
            gemm_row("a/uniform", "forward_backward", "gmoe_linear_fp8_tensorwise+cached_weights", 910.0,
                     dtype="fp8", bare_ms=1.3 * 100.0 / 910.0, native_alone_ms=1.2 * 100.0 / 910.0),
            gemm_row("m/uniform", "forward_backward", "gmoe", 500.0),
            gemm_row("m/uniform", "forward_backward", "gmoe_unfused", 480.0),
        ]
        torch_rows = [
            gemm_row("a/uniform", "fprop", "torch", 640.0, correct=None),
            gemm_row("b/uniform", "fprop", "torch", 750.0, correct=None),
            gemm_row("a/uniform", "fprop", "torch_fp8_rowwise", 1000.0, correct=None, dtype="fp8"),
            gemm_row("a/uniform", "fprop", "torch_fp8_blockwise", 960.0, correct=None, dtype="fp8"),
            gemm_row("a/uniform", "forward_backward", "torch_linear", 560.0, correct=None),
            gemm_row("a/uniform", "forward_backward", "torch_linear_fp8_rowwise", 260.0, correct=None, dtype="fp8"),
            gemm_row("a/uniform", "forward_backward", "torch_linear_fp8_rowwise_compile", 650.0, correct=None,
                     dtype="fp8"),
            gemm_row("m/uniform", "forward_backward", "torch_compile", 400.0, correct=None),
        ]
        stdout, merged, md = self.report(
            self.write("gmoe.json", ours, gpu="H100", commit="abc", date="today", suite="public"),
            self.write("torch.json", torch_rows, torch="2.11",
                       errors=[{"case": "a/skewed", "pass": "wgrad", "impl": "torch_fp8_rowwise",
                                "error": "skipped: counts"},
                               {"case": "a/skewed", "impl": "torch_compile", "error": "compile failed"}]))
        # The error of one (case, pass, impl) is a skipped row; one without a pass stays an error.
        self.assertEqual(len(merged["rows"]), len(ours) + len(torch_rows) + 1)
        skipped = [r for r in merged["rows"] if r.get("skipped")]
        self.assertEqual([(r["case"], r["pass"], r["impl"], r["dtype"], r["skipped"], r["tflops"]) for r in skipped],
                         [("a/skewed", "wgrad", "torch_fp8_rowwise", "fp8", "counts", None)])
        self.assertIn("- a/skewed torch_fp8_rowwise: counts", md)
        self.assertEqual((merged["gpu"], merged["commit"], merged["torch"]), ("H100", "abc", "2.11"))
        for title in ("## bf16 grouped GEMM", "## FP8 grouped GEMM alone", "## FP8 quantization",
                      "## expert MLP", "## GroupedLinear (bias, f32 main_grad) against the torch composition",
                      "## GroupedLinear with FP8 recipes against the torch composition",
                      "GroupedLinear (grouped bias, f32 main_grad accumulated)",
                      "against the bf16 layer timed interleaved with it",
                      "against gmoe's bf16 grouped GEMM of the same pass", "Errors:"):
            self.assertIn(title, md)
        # bf16 GEMM: 800/640 = 1.25x and 600/750 = 0.80x, geomean 1.00x.
        self.assertIn("1.25x", md)
        self.assertIn("0.80x", md)
        self.assertIn(f"{math.sqrt(1.25 * 0.8):.2f}x", md)
        # The layer against torch's: bf16 700/560 = 1.25x, and no bf16-against-FP8 column; FP8 910/650
        # = 1.40x (compiled), 3.50x (eager), and no FP8-against-bf16 column.
        bf16_md = md.split("## GroupedLinear (bias, f32 main_grad) against the torch composition")[1].split("\n\n")[1]
        self.assertIn("1.25x", bf16_md)
        self.assertNotIn("fp8", bf16_md)
        fp8_md = md.split("## GroupedLinear with FP8 recipes against the torch composition")[1].split("\n\n")[1]
        self.assertIn("1.40x", fp8_md)
        self.assertIn("3.50x", fp8_md)
        self.assertNotIn("/torch_linear ", fp8_md)
        # The FP8 layer against the bf16 layer timed beside it: bare_ms / ms = 1.30x, and timed alone:
        # native_alone_ms / ms = 1.20x; overhead 5.0%.
        fp8_layer_md = md.split("against the bf16 layer timed interleaved with it")[1].split("\n\n")[1]
        self.assertIn("1.30x", fp8_layer_md)
        self.assertIn("| 1.20x |", fp8_layer_md)
        self.assertIn("5.0%", md)
        # FP8 alone: blockwise 1200 against torch's rowwise 1000 = 1.20x and torch's blockwise (cuBLASLt per
        # expert) 960 = 1.25x, each its own column.
        fp8_alone = md.split("## FP8 grouped GEMM alone")[1].split("\n\n")[1]
        self.assertIn("gmoe_fp8_blockwise/torch_fp8_rowwise", fp8_alone)
        self.assertIn("gmoe_fp8_blockwise/torch_fp8_blockwise", fp8_alone)
        self.assertIn("1.20x", fp8_alone)
        self.assertIn("1.25x", fp8_alone)
        # The FP8 GEMMs against the bf16 GEMM timed interleaved with them: 1.45x alone, 1.45 * 1000/1200
        # = 1.21x with the quantization; the layer's and the MLP's rows are not in this table.
        fp8_gemm_md = md.split("against gmoe's bf16 grouped GEMM of the same pass")[1].split("\n\n")[1]
        self.assertIn("| fp8_blockwise | 1200.0 | 827.6 | 1.45x |", fp8_gemm_md)
        self.assertIn("| fp8_blockwise_with_quant | 1000.0 | 827.6 | 1.21x |", fp8_gemm_md)
        self.assertNotIn("forward_backward", fp8_gemm_md)
        # The MLP: gmoe / torch_compile = 1.25x.
        self.assertIn("1.25x", md.split("## expert MLP")[1])
        self.assertIn("a/skewed torch_fp8_rowwise: counts", stdout)
        self.assertIn("compile failed", stdout)

    def test_moe_tables(self):
        def moe_row(case, pass_name, impl, ms, **extra):
            r = {"case": case, "kind": "moe", "pass": pass_name, "impl": impl, "dtype": "bf16", "ms": ms,
                 "tflops": 100.0 / ms, "correct": None}
            r.update(extra)
            return r

        ours = [moe_row("moe_q/uniform", "forward_backward", "gmoe", 10.0, correct=True, kept_bytes_per_token=3000.0,
                        peak_mib=900.0),
                moe_row("moe_q/uniform", "forward_backward", "gmoe_graph", 9.5, correct=True),
                moe_row("moe_q/uniform", "forward_backward", "gmoe_keep_input", 10.3, correct=True,
                        kept_bytes_per_token=4000.0, peak_mib=950.0),
                moe_row("moe_q/uniform", "forward_backward", "gmoe_router", 0.5),
                moe_row("moe_q/uniform", "forward_backward", "gmoe_permute", 0.5),
                moe_row("moe_q/uniform", "forward_backward", "gmoe_experts", 8.0),
                moe_row("moe_q/uniform", "forward_backward", "gmoe_combine", 0.5),
                moe_row("moe_q/uniform", "forward", "gmoe", 4.0, correct=True),
                moe_row("moe_q/uniform", "forward", "gmoe_permute", 0.1, gbps=2400.0, copy_gbps=3000.0),
                moe_row("moe_q/uniform", "copy", "device_copy", 0.1, gbps=3000.0),
                # an mlp case of the same model name: not in the MoE tables, and they not in its
                gemm_row("q/uniform", "forward_backward", "gmoe", 500.0)]
        torch_rows = [moe_row("moe_q/uniform", "forward_backward", "torch", 20.0, kept_bytes_per_token=7000.0,
                              peak_mib=2000.0),
                      moe_row("moe_q/uniform", "forward_backward", "torch_compile", 16.0, kept_bytes_per_token=6000.0,
                              peak_mib=1500.0),
                      moe_row("moe_q/uniform", "forward", "torch_compile", 5.0),
                      gemm_row("q/uniform", "forward_backward", "torch_compile", 400.0, correct=None)]
        stdout, merged, md = self.report(
            self.write("gmoe.json", ours, gpu="H100", commit="abc", date="today", suite="public"),
            self.write("torch.json", torch_rows, torch="2.11", notes=["gmoe_torch: absent (no MoELayer)"]))
        self.assertEqual(len(merged["rows"]), len(ours) + len(torch_rows))
        block = md.split("## MoE block")[1]
        # compiled / gmoe = 16 / 10 = 1.60x; kept 3000 / 6000 = 0.50x; peak memory of each.
        self.assertIn("| moe_q/uniform | 10.000 | 9.500 | 10.300 | - | - | 20.000 | 16.000 | 1.60x | - | 3000 | 4000 | - | "
                      "- | 7000 | 6000 | 0.50x | 900.0 | 950.0 | - | - | 2000.0 | 1500.0 | yes |", block)
        # The phases: 9.5 of the block's 10 ms, the experts 80% of it; the ceiling 16 / 8 = 2.00x.
        self.assertIn("| moe_q/uniform | 10.000 | 10.300 | 0.500 | 0.500 | 8.000 | 0.500 | 9.500 | 0.500 | 80% | "
                      "16.000 | 1.60x | 2.00x |", block)
        self.assertIn("| moe_q/uniform | gmoe_permute | forward | 0.100 | 2400 | 3000 | 80.0% |", block)
        self.assertNotIn("device_copy", block)
        self.assertIn("Note: gmoe_torch: absent (no MoELayer)", md)
        self.assertIn("note: gmoe_torch: absent", stdout)
        # the expert MLP table has the mlp case only: 500 / 400 = 1.25x
        mlp = md.split("## expert MLP")[1].split("## MoE block")[0]
        self.assertIn("q/uniform", mlp)
        self.assertNotIn("moe_q", mlp)
        self.assertIn("1.25x", mlp)

    def test_offload_tables(self):
        row = ms_row
        # A file written before the rows had their kind and numeric fields: the numbers are in the notes.
        old = [row("o/uniform", "step", "gmoe_stack", 10.0, correct=True,
                   note="activations after forward 1000.0 MiB, step peak 3000.0 MiB"),
               row("o/uniform", "step", "gmoe_stack_offload", 22.0, correct=True,
                   note="activations after forward 250.0 MiB (75% less), step peak 2500.0 MiB, 750.0 MiB offloaded; "
                        "1.10x max(step without 10.000 ms, copies 20.000 ms)"),
               row("o/uniform", "copy_d2h", "offloader", 9.0, note="50.0 GB/s, 100% of the plain pinned copy"),
               row("o/uniform", "copy_d2h", "pinned_memcpy", 9.0, note="50.0 GB/s"),
               row("o/uniform", "copy_h2d", "offloader", 11.0, note="45.0 GB/s, 90% of the plain pinned copy"),
               row("o/uniform", "copy_h2d", "pinned_memcpy", 9.9, note="50.0 GB/s"),
               gemm_row("m/uniform", "forward_backward", "gmoe", 500.0)]
        new = [row("o/skewed", "step", "gmoe_stack", 10.0, kind="offload", correct=True, activations_mib=800.0,
                   peak_mib=2000.0),
               row("o/skewed", "step", "gmoe_stack_offload", 12.0, kind="offload", correct=True,
                   activations_mib=200.0, peak_mib=1900.0, offloaded_mib=600.0),
               row("o/skewed", "step", "gmoe_stack_offload_all", 16.0, kind="offload", correct=False,
                   activations_mib=40.0, peak_mib=1800.0, offloaded_mib=800.0),
               row("o/skewed", "copy_d2h", "offloader", 5.0, kind="offload", gbps=120.0, copy_gbps=125.0),
               row("o/skewed", "copy_d2h", "pinned_memcpy", 4.8, kind="offload", gbps=125.0),
               row("o/skewed", "copy_h2d", "offloader", 5.0, kind="offload", gbps=120.0, copy_gbps=120.0),
               row("o/skewed", "copy_h2d", "pinned_memcpy", 5.0, kind="offload", gbps=120.0)]
        stdout, merged, md = self.report(
            self.write("old.json", old, gpu="H100", commit="abc", date="today", suite="public"),
            self.write("new.json", new))
        self.assertEqual({r.get("kind") for r in merged["rows"] if r["case"].startswith("o/")}, {"offload"})
        block = md.split("## Activation offloading")[1]
        # old: copies 9 + 11 = 20 ms, 22 / max(10, 20) = 1.10x; activations 1000 -> 250 MiB, 75% less.
        self.assertIn("| o/uniform | last layer kept | 10.000 | 22.000 | 20.000 | 1.10x | 1000.0 | 250.0 | 75.0% | "
                      "3000.0 | 2500.0 | 750.0 | yes |", block)
        # new: copies 5 + 5 = 10 ms, 12 / max(10, 10) = 1.20x; 800 -> 200 MiB; geomean sqrt(1.1 * 1.2).
        self.assertIn("| o/skewed | last layer kept | 10.000 | 12.000 | 10.000 | 1.20x | 800.0 | 200.0 | 75.0% | "
                      "2000.0 | 1900.0 | 600.0 | yes |", block)
        self.assertIn(f"| geomean | last layer kept |  |  |  | {math.sqrt(1.1 * 1.2):.2f}x |", block)
        # every layer offloaded: its copies at the measured bandwidth, 10 ms * 800 / 600 MiB = 13.333 ms,
        # 16 / 13.333 = 1.20x; 800 -> 40 MiB, 95% less; its dx differed: NO. The old file has no such row.
        self.assertIn("| o/skewed | every layer | 10.000 | 16.000 | 13.333 | 1.20x | 800.0 | 40.0 | 95.0% | "
                      "2000.0 | 1800.0 | 800.0 | NO |", block)
        self.assertIn("| geomean | every layer |  |  |  | 1.20x |", block)
        self.assertNotIn("| o/uniform | every layer", block)
        # the copies: the pinned copy's time over the offloader's (same bytes), GB/s from the note or the field
        self.assertIn("| o/uniform | copy_h2d | 11.000 | 45.0 | 9.900 | 50.0 | 90.0% |", block)
        self.assertIn("| o/skewed | copy_d2h | 5.000 | 120.0 | 4.800 | 125.0 | 96.0% |", block)
        # no TFLOP/s table takes them (their tflops are 0)
        before = md.split("## Activation offloading")[0]
        self.assertNotIn("o/uniform", before)
        self.assertNotIn("gmoe_stack", before)
        self.assertIn("Activation offloading", stdout)

    def test_module_tables(self):
        def row(*args, **extra):
            return ms_row(*args, tflops=50.0, **extra)

        mlp = [gemm_row("m/uniform", "forward_backward", "gmoe", 500.0),
               gemm_row("m/uniform", "forward_backward", "torch_compile", 400.0, correct=None)]
        module = [row("m/uniform", "forward_backward", "gmoe_torch", 10.2, correct=True),
                  row("m/uniform", "forward_backward", "torch", 15.3),
                  row("m/uniform", "forward_backward", "torch_compile", 11.22),
                  row("m/uniform", "forward_backward", "gmoe", 10.0, correct=True)]
        overhead = [{"case": "op_overhead", "pass": "call", "impl": "gmoe_op_overhead", "dtype": "bf16",
                     "us_per_call": 25.0, "correct": None},
                    {"case": "op_overhead", "pass": "call", "impl": "torch_op_overhead", "dtype": "bf16",
                     "us_per_call": 12.5, "correct": None}]
        # torch_module_bench.py marks its rows; a merged file written before it did holds the module bench's
        # rows after the mlp mode's of the same case, pass and impl.
        marked = [dict(r, kind="module") for r in module + overhead]
        for inputs in ((self.write("mlp.json", mlp, gpu="H100", commit="abc", date="today", suite="public"),
                        self.write("module.json", marked, torch="2.11")),
                       (self.write("merged.json", mlp + module + overhead, gpu="H100", commit="abc", date="today",
                                   suite="public"),)):
            with self.subTest(inputs=[os.path.basename(i) for i in inputs]):
                stdout, merged, md = self.report(*inputs)
                self.assertEqual(sum(r.get("kind") == "module" for r in merged["rows"]), len(marked))
                # the expert MLP table has the mlp mode's rows only: 500 / 400 = 1.25x
                mlp_md = md.split("## expert MLP")[1].split("## PyTorch package")[0]
                self.assertIn("1.25x", mlp_md)
                self.assertNotIn("50.0", mlp_md)
                # the module: 10.2 / 10.0 = 1.020 of the C++ layer; torch 15.3 / 10.2 = 1.50x, compiled 1.10x
                block = md.split("## PyTorch package")[1]
                self.assertIn("| m/uniform | forward_backward | 10.200 | 10.000 | 15.300 | 11.220 | 1.020 | 1.50x | "
                              "1.10x | yes |", block)
                self.assertIn("| op_overhead | 25.0 | 12.5 | 2.00x | 12.5 |", block)
                self.assertIn("PyTorch package", stdout)

    def test_train_table(self):
        def part(impl, p, ms, **extra):
            return dict({"case": "train_moe_lm/cfg", "kind": "train", "pass": p, "impl": impl, "dtype": "bfloat16",
                         "ms": ms, "tflops": None, "correct": None}, **extra)

        gemm = [gemm_row("a/uniform", "fprop", "gmoe", 800.0)]
        config = dict(layers=2, hidden=2048, heads=16, experts=64, top_k=8, ffn=768, activation="swiglu",
                      seq_len=1024, batch=64, recipe=None, delay_wgrad=False, weight_layout="stacked",
                      dtype="bfloat16", cuda_graph=True, compile=True, optimizer="AdamW fused")
        train = [part("gmoe", "step", 30.0, tokens_per_s=500000.0, peak_mib=900.0, config=config),
                 part("gmoe", "moe", 10.0), part("gmoe", "optimizer", 8.0), part("gmoe", "rest", 12.0),
                 part("torch", "step", 36.0, tokens_per_s=416667.0, peak_mib=1000.0, config=config),
                 part("torch", "moe", 15.0), part("torch", "optimizer", 8.0), part("torch", "rest", 13.0),
                 # a configuration with one model only: no finding
                 part("gmoe", "step", 20.0, case="train_moe_lm/alone"), part("gmoe", "moe", 15.0, case="train_moe_lm/alone")]
        stdout, merged, md = self.report(self.write("gmoe.json", gemm, gpu="H100", commit="abc", date="today"),
                                         self.write("train.json", train))
        self.assertEqual(sum(r.get("kind") == "train" for r in merged["rows"]), len(train))
        block = md.split("## Training step")[1]
        # gmoe: MoE 10 of 30 ms (33%); torch/gmoe step 36 / 30 = 1.20x, MoE 15 / 10 = 1.50x; Amdahl bound
        # 36 / (36 - 15 + 10) = 1.16x
        self.assertIn("| train_moe_lm/cfg | gmoe | 30.00 | 10.00 | 8.00 | 12.00 | 33% | 500000 | 900 | 1.20x | 1.50x | "
                      "1.16x |", block)
        self.assertIn("| train_moe_lm/cfg | torch | 36.00 | 15.00 | 8.00 | 13.00 | 42% | 416667 | 1000 | - | - | - |",
                      block)
        # the finding the target asks for, with the share of the step that qualifies it and the configuration
        finding = ("train_moe_lm/cfg: gmoe trains 1.20x the tokens/s of the PyTorch model (target: >= 1.2x) at a "
                   "configuration where the MoE blocks are 33% of the step (42% of the PyTorch model's): 2 layers, "
                   "hidden 2048, 16 heads, 64 experts top-8, expert FFN 768 swiglu, batch 64 x 1024, bfloat16, "
                   "AdamW fused; peak memory 0.90x the PyTorch model's.")
        self.assertIn(f"- {finding}", block)
        self.assertIn(finding, stdout)
        self.assertNotIn("train_moe_lm/alone:", md)
        # the train rows stay out of the TFLOP/s tables
        self.assertNotIn("train_moe_lm", md.split("## Training step")[0])
        self.assertIn("Training step", stdout)

    def test_ep_tables(self):
        def ep(case, impl, pass_name, ms, **extra):
            return ms_row(case, pass_name, impl, ms, kind="ep", ep_size=2, **extra)

        mib = 2 ** 20
        rows = [ep("ep_a/uniform", "nccl_a2a", "all_to_all", 2.0, bytes=300 * mib, gbps=300 * mib / 2e-3 / 1e9),
                ep("ep_a/uniform", "torch_ep", "forward", 6.0), ep("ep_a/uniform", "torch_ep", "forward_backward", 20.0,
                                                                   peak_mib=900.0),
                ep("ep_a/uniform", "gmoe_ep", "forward", 4.0, correct=True),
                ep("ep_a/uniform", "gmoe_ep", "forward_backward", 12.5, correct=True, peak_mib=700.0),
                ep("ep_a/uniform", "gmoe_ep", "dispatch", 2.5, correct=True, bytes=300 * mib,
                   gbps=300 * mib / 2.5e-3 / 1e9),
                ep("ep_a/uniform", "gmoe_ep", "combine", 2.0, correct=False, bytes=300 * mib,
                   gbps=300 * mib / 2e-3 / 1e9),
                ep("ep_a/uniform", "torch_ep", "dispatch", 5.0, bytes=300 * mib, gbps=300 * mib / 5e-3 / 1e9),
                ep("ep_a/uniform", "torch_ep", "combine", 4.0, bytes=300 * mib, gbps=300 * mib / 4e-3 / 1e9),
                ep("ep_b/skewed", "nccl_a2a", "all_to_all", 1.0, bytes=100 * mib, gbps=100 * mib / 1e-3 / 1e9),
                ep("ep_b/skewed", "torch_ep", "forward", 3.0), ep("ep_b/skewed", "torch_ep", "forward_backward", 9.0),
                ep("ep_b/skewed", "torch_ep", "dispatch", 2.0, bytes=100 * mib, gbps=100 * mib / 2e-3 / 1e9),
                dict(ep("ep_b/skewed", "gmoe_ep", "forward", None), skipped="no EpGroup"),
                dict(ep("ep_b/skewed", "gmoe_ep", "forward_backward", None), skipped="no EpGroup")]
        gemm = [gemm_row("a/uniform", "fprop", "gmoe", 800.0)]
        stdout, merged, md = self.report(self.write("gmoe.json", gemm, gpu="H100", commit="abc", date="today"),
                                         self.write("ep.json", rows))
        self.assertEqual(sum(r.get("kind") == "ep" for r in merged["rows"]), len(rows))
        block = md.split("## Expert parallelism")[1]
        # torch_ep / gmoe_ep: forward 6 / 4 = 1.50x, forward + backward 20 / 12.5 = 1.60x
        self.assertIn("| ep_a/uniform | 2 | 4.000 | 6.000 | 1.50x | 12.500 | 20.000 | 1.60x | 700.0 | 900.0 | yes |",
                      block)
        self.assertIn("| ep_b/skewed | 2 | - | 3.000 | - | - | 9.000 | - | - | - | - |", block)
        # dispatch 2.5 ms of the bytes NCCL moves in 2 ms: 80% (torch's 5 ms: 40%); combine 100%, checked and
        # wrong: NO
        self.assertIn("| ep_a/uniform | dispatch | 300.0 | 157 | 2.500 | 126 | 80.0% | 5.000 | 63 | 40.0% | yes |", block)
        self.assertIn("| ep_a/uniform | combine | 300.0 | 157 | 2.000 | 157 | 100.0% | 4.000 | 79 | 50.0% | NO |", block)
        self.assertIn("| ep_b/skewed | dispatch | 100.0 | 105 | - | - | - | 2.000 | 52 | 50.0% | - |", block)
        self.assertNotIn("| ep_b/skewed | combine", block)
        self.assertIn("| geomean dispatch |  |  |  |  |  | 80.0% |  |  |  |  |", block)
        self.assertIn("| geomean combine |  |  |  |  |  | 100.0% |  |  |  |  |", block)
        self.assertIn("ep_b/skewed gmoe_ep: no EpGroup", md)
        # the ep rows stay out of the other tables
        self.assertNotIn("ep_a", md.split("## Expert parallelism")[0])
        self.assertIn("Expert parallelism", stdout)

    def test_ep_overlap_table(self):
        def ep(impl, pass_name, ms, **extra):
            return ms_row("ep_a/uniform", pass_name, impl, ms, kind="ep", **extra)

        passes = {"forward_eager": 10.0, "backward_sequential": 30.0, "backward_overlap": 27.5, "exchanges": 3.0,
                  "exchanges_dispatch": 1.25, "exchanges_combine": 1.5, "wgrad": 8.0}
        rows = [ep("gmoe_ep", p, ms, correct=True if p == "backward_overlap" else None) for p, ms in passes.items()]
        rows += [ep("gmoe_ep_trimmed", p, 2 * ms, correct=False if p == "backward_overlap" else None)
                 for p, ms in passes.items()]
        # torch_ep_baseline.py's gmoe_ep rows of the same case stay in the other EP tables only
        rows += [ep("gmoe_ep", "forward", 4.0, correct=True), ep("torch_ep", "forward", 6.0)]
        stdout, merged, md = self.report(self.write("ep.json", rows))
        block = md.split("## Expert parallelism: backward overlap (C++)")[1]
        # saved = 30 - 27.5; dispatch + combine alone = 1.25 + 1.5
        self.assertIn("| ep_a/uniform | cached | 10.000 | 30.000 | 27.500 | 2.500 | 3.000 | 2.750 | 8.000 | yes |", block)
        self.assertIn("| ep_a/uniform | trimmed each step | 20.000 | 60.000 | 55.000 | 5.000 | 6.000 | 5.500 | 16.000 "
                      "| NO |", block)
        self.assertNotIn("4.000", block)
        self.assertIn("| ep_a/uniform | - | 4.000 | 6.000 | 1.50x |", md.split("## Expert parallelism")[1])
        self.assertIn("backward in order and overlapped", stdout)

    def test_unreadable_inputs(self):
        good = self.write("gmoe.json", [gemm_row("a/uniform", "fprop", "gmoe", 800.0)])
        stdout, merged, _ = self.report(os.path.join(self.dir.name, "missing.json"), good)
        self.assertIn("skipping", stdout)
        self.assertEqual(len(merged["rows"]), 1)
        p = run(REPORT, os.path.join(self.dir.name, "missing.json"), "--out", os.path.join(self.dir.name, "o.json"))
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("no readable input", p.stderr)


if __name__ == "__main__":
    unittest.main(verbosity=1)

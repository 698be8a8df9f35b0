#!/usr/bin/env python3
"""tests/bench/test_bench_skips.py — gmoe-bench keeps the run when one case cannot run.

Runs gmoe-bench (the CPU backend here) on tests/bench/skips_suite.json with FP8 rows asked for:
the FP8 rows of every case (one of them with K = 24, not a multiple of 16) and an mlp case whose
activation does not exist cannot run. They must come back as rows marked `skipped` with the
reason, while every other case runs, is checked and lands in the JSON and markdown files, and
bench/report.py must table such a file. The same for the offload mode on the suite's mlp cases,
whose rows are tabled in ms and MiB (they count no FLOPs), not in TFLOP/s.

    python3 tests/bench/test_bench_skips.py PATH/TO/gmoe-bench        (ctest: bench_skips)
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.environ.get("GMOE_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SUITE = os.path.join(ROOT, "tests", "bench", "skips_suite.json")
BENCH = None  # set from argv


class BenchRun(unittest.TestCase):
    """gmoe-bench run once on the suite (CPU backend) with ARGS, into a JSON and a markdown file."""
    ARGS = ()

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.json_path = os.path.join(cls.tmp.name, "out.json")
        cls.md_path = os.path.join(cls.tmp.name, "out.md")
        cls.proc = subprocess.run([BENCH, "--suite", SUITE, "--backend", "cpu", *cls.ARGS,
                                   "--json", cls.json_path, "--markdown", cls.md_path],
                                  capture_output=True, text=True, timeout=600)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()


class BenchSkips(BenchRun):
    ARGS = ("--fp8", "blockwise,mxfp8")

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with open(SUITE) as f:
            cls.cases = json.load(f)["cases"]

    def rows(self):
        with open(self.json_path) as f:
            return json.load(f)["rows"]

    def test_the_run_succeeds_and_says_what_it_is(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stdout + self.proc.stderr)
        self.assertIn("correctness and smoke run", self.proc.stdout)
        self.assertIn("rows skipped", self.proc.stdout)

    def test_every_runnable_case_is_run_and_checked(self):
        rows = self.rows()
        for c in self.cases:
            if c["kind"] == "gemm":
                want = {("gmoe", p) for p in ("fprop", "dgrad", "wgrad")}
                want |= {("gmoe_linear", p) for p in ("forward", "forward_backward")}
            elif c["activation"] != "no_such_activation":
                want = {(i, p) for i in ("gmoe", "gmoe_unfused") for p in ("forward", "forward_backward")}
            else:
                continue
            got = {(r["impl"], r["pass"]) for r in rows if r["case"] == c["name"] and "skipped" not in r}
            self.assertEqual(got, want, c["name"])
            for r in rows:
                if r["case"] == c["name"] and "skipped" not in r:
                    self.assertIs(r["correct"], True, r)
                    self.assertGreater(r["ms"], 0, r)

    def test_unsupported_rows_are_skipped_with_a_reason(self):
        rows = self.rows()
        skipped = [r for r in rows if "skipped" in r]
        for c in (c for c in self.cases if c["kind"] == "gemm"):
            for impl in ("gmoe_fp8_blockwise", "gmoe_mxfp8"):
                got = sorted(r["pass"] for r in skipped if r["case"] == c["name"] and r["impl"] == impl)
                self.assertEqual(got, ["dgrad", "fprop", "wgrad"], (c["name"], impl))
        bad = [r for r in skipped if r["case"] == "bad_activation/uniform"]
        self.assertEqual(sorted(r["pass"] for r in bad), ["forward", "forward_backward"])
        self.assertIn("no_such_activation", bad[0]["skipped"])
        for r in skipped:
            self.assertTrue(r["skipped"], r)
            self.assertIsNone(r["ms"], r)
            self.assertIsNone(r["tflops"], r)
            self.assertIsNone(r["correct"], r)

    def test_the_markdown_lists_the_skips(self):
        with open(self.md_path) as f:
            md = f.read()
        self.assertIn("Skipped (not run)", md)
        self.assertIn("bad_activation/uniform gmoe:", md)
        self.assertIn("correctness and smoke run", md)

    def test_the_report_tables_the_skips(self):
        out = os.path.join(self.tmp.name, "report.json")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), self.json_path, "--out", out],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("Skipped (not run)", p.stdout)
        self.assertIn("k24/skewed gmoe_mxfp8:", p.stdout)


class BenchOffload(BenchRun):
    ARGS = ("--mode", "offload")

    def test_rows_carry_their_kind_and_numbers(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stdout + self.proc.stderr)
        with open(self.json_path) as f:
            rows = json.load(f)["rows"]
        self.assertEqual({r.get("kind") for r in rows}, {"offload"})
        run = {r["impl"]: r for r in rows if r["case"] == "mlp/uniform"}
        self.assertEqual(set(run), {"gmoe_stack", "gmoe_stack_offload", "gmoe_stack_offload_all"})
        for r in run.values():
            self.assertIs(r["correct"], True, r)
            self.assertGreater(r["activations_mib"], 0, r)
            self.assertGreaterEqual(r["peak_mib"], r["activations_mib"], r)
        kept, every = run["gmoe_stack_offload"], run["gmoe_stack_offload_all"]
        self.assertLess(kept["activations_mib"], run["gmoe_stack"]["activations_mib"])
        # Every layer offloaded: the last layer's activations go too, so more bytes move and less is held.
        self.assertLess(every["activations_mib"], kept["activations_mib"])
        self.assertGreater(every["offloaded_mib"], kept["offloaded_mib"])
        self.assertGreater(kept["offloaded_mib"], 0)
        self.assertIn("last layer kept", kept["note"])
        self.assertIn("every layer offloaded", every["note"])
        self.assertNotIn("offloaded_mib", run["gmoe_stack"])
        bad = [r for r in rows if r["case"] == "bad_activation/uniform"]
        self.assertEqual([(r["impl"], r["pass"]) for r in bad], [("gmoe_stack_offload", "step")])
        self.assertIn("no_such_activation", bad[0]["skipped"])

    def test_the_tables_are_in_ms_and_mib(self):
        with open(self.md_path) as f:
            markdown = f.read()
        for text in (self.proc.stdout, markdown):
            self.assertIn("activations MiB", text)
            self.assertNotIn("TFLOP/s 0", text.replace("|", ""))
            self.assertNotIn("gmoe_stack TFLOP/s", text)
        out = os.path.join(self.tmp.name, "report.json")
        md = os.path.join(self.tmp.name, "report.md")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), self.json_path, "--out", out,
                            "--markdown", md], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(md) as f:
            report = f.read()
        self.assertIn("## Activation offloading", report)
        offload = report.split("## Activation offloading")[1]
        self.assertIn("| mlp/uniform | last layer kept |", offload)
        self.assertIn("| mlp/uniform | every layer |", offload)
        self.assertIn("| bad_activation/uniform | last layer kept | - | skipped |", report)


if __name__ == "__main__":
    BENCH = os.path.abspath(sys.argv.pop(1)) if len(sys.argv) > 1 else None
    if not BENCH or not os.access(BENCH, os.X_OK):
        sys.exit("usage: test_bench_skips.py PATH/TO/gmoe-bench")
    unittest.main()

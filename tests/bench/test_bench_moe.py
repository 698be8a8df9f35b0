#!/usr/bin/env python3
"""tests/bench/test_bench_moe.py — gmoe-bench --mode moe on the CPU backend.

Runs gmoe-bench on tests/bench/moe_suite.json: two small cases (uniform routing; skewed routing with
an expert that is never chosen and gpt-oss's clamped SwiGLU), one whose top_k exceeds E (the layer
refuses it), one of zero tokens. Every runnable case must come back checked and correct with its
three passes, its memory (peak, bytes kept for backward per token, at least what the layer must
keep: x, the logits and FC1's output h), the layer keeping its permuted rows (gmoe_keep_input:
checked bitwise against gmoe, keeping exactly those rows' bytes more), the block's phases alone
(gmoe_router, gmoe_permute, gmoe_experts, gmoe_combine) and permute / combine rows beside a copy; the refused
case as skipped rows naming top_k, while the run goes on; and bench/report.py must table the file.

    python3 tests/bench/test_bench_moe.py PATH/TO/gmoe-bench        (ctest: bench_moe)
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.environ.get("GMOE_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SUITE = os.path.join(ROOT, "tests", "bench", "moe_suite.json")
BENCH = None  # set from argv


class BenchMoe(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.json_path = os.path.join(cls.tmp.name, "out.json")
        cls.md_path = os.path.join(cls.tmp.name, "out.md")
        cls.proc = subprocess.run([BENCH, "--suite", SUITE, "--backend", "cpu", "--mode", "moe", "--iters", "2",
                                   "--json", cls.json_path, "--markdown", cls.md_path],
                                  capture_output=True, text=True, timeout=600)
        with open(SUITE) as f:
            cls.cases = {c["name"]: c for c in json.load(f)["cases"]}
        with open(cls.json_path) as f:
            cls.rows = json.load(f)["rows"]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_the_run_succeeds(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stdout + self.proc.stderr)
        self.assertIn("MoELayer", self.proc.stdout)

    def test_every_runnable_case_is_run_checked_and_measured(self):
        for name in ("tiny/uniform", "tiny/skewed", "no_tokens/uniform"):
            c = self.cases[name]
            rows = {(r["impl"], r["pass"]): r for r in self.rows if r["case"] == name}
            for p in ("forward", "backward", "forward_backward"):
                r = rows[("gmoe", p)]
                self.assertEqual(r["kind"], "moe")
                self.assertIs(r["correct"], True, r)
                self.assertGreater(r["ms"], 0, r)
                self.assertIn("kept_bytes_per_token", r)
            fb = rows[("gmoe", "forward_backward")]
            self.assertIn("dlogits", fb["note"])
            keep = rows[("gmoe_keep_input", "forward_backward")]
            self.assertIs(keep["correct"], True, keep)
            self.assertIn("bitwise", keep["note"])
            for phase in ("gmoe_router", "gmoe_permute", "gmoe_experts", "gmoe_combine"):
                self.assertGreater(rows[(phase, "forward_backward")]["ms"], 0, phase)
            if c["tokens"] > 0:
                self.assertIn("out: max err", fb["note"])
                # x, the bf16 logits and FC1's output h (top_k rows of 2·ffn per token) at least
                least = 2 * (c["hidden"] + c["E"] + c["top_k"] * 2 * c["ffn"])
                self.assertGreater(fb["kept_bytes_per_token"], least, fb)
                self.assertGreater(fb["peak_mib"] * 2 ** 20, c["tokens"] * least, fb)
                # the permuted rows (top_k bf16 copies of each token) are what gmoe does not keep
                self.assertAlmostEqual(keep["kept_bytes_per_token"] - fb["kept_bytes_per_token"],
                                       2 * c["top_k"] * c["hidden"], places=6)
            for op in ("gmoe_permute", "gmoe_combine"):
                for p in ("forward", "backward"):
                    r = rows[(op, p)]
                    self.assertIn("gbps", r)
                    self.assertIn("copy_gbps", r)
            self.assertIn(("device_copy", "copy"), rows)

    def test_a_refused_case_is_skipped_with_the_reason(self):
        skipped = [r for r in self.rows if r["case"] == "k_above_e/uniform"]
        self.assertEqual(sorted(r["pass"] for r in skipped), ["backward", "forward", "forward_backward"])
        for r in skipped:
            self.assertIn("top_k", r["skipped"])
            self.assertIsNone(r["ms"])
            self.assertIsNone(r["correct"])
        self.assertIn("k_above_e/uniform gmoe:", self.proc.stdout)

    def test_the_markdown_and_the_report(self):
        with open(self.md_path) as f:
            md = f.read()
        self.assertIn("MoELayer (router top-k, permute, GroupedMLP, combine)", md)
        self.assertIn("Permute and combine alone", md)
        out = os.path.join(self.tmp.name, "report.json")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), self.json_path, "--out", out],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("MoE block forward+backward", p.stdout)
        self.assertIn("Permute and combine alone against a device copy", p.stdout)


if __name__ == "__main__":
    BENCH = os.path.abspath(sys.argv.pop(1)) if len(sys.argv) > 1 else None
    if not BENCH or not os.access(BENCH, os.X_OK):
        sys.exit("usage: test_bench_moe.py PATH/TO/gmoe-bench")
    unittest.main()

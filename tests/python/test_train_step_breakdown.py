"""bench/train_step_breakdown.py runs on the CPU (tiny preset), times each part of both models, and
writes rows that bench/report.py merges into a training-step table."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import train_step_breakdown as tsb  # noqa: E402


def test_breakdown_of_both_models_on_the_cpu(tmp_path):
    out, md = tmp_path / "b.json", tmp_path / "b.md"
    rows = tsb.main(["--iters", "1", "--warmup", "0", "--device", "cpu", "--steps", "4", "--layers", "1",
                     "--json", str(out), "--markdown", str(md)])
    assert [r["impl"] for r in rows] == ["gmoe", "torch"]
    for r in rows:
        assert r["step_ms"] > 0 and r["moe_ms"] > 0 and r["optimizer_ms"] > 0
    text = md.read_text()
    assert "| gmoe |" in text and "| torch |" in text and "Amdahl" in text
    # The JSON is in the results format: one train row per model and part, which report.py tabulates.
    written = json.loads(out.read_text())["rows"]
    assert sorted((r["impl"], r["pass"]) for r in written) == sorted(
        (i, p) for i in ("gmoe", "torch") for p in ("step", "moe", "optimizer", "rest"))
    assert all(r["kind"] == "train" for r in written)
    merged, report_md = tmp_path / "r.json", tmp_path / "r.md"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "report.py"), str(out), "--out", str(merged),
                        "--markdown", str(report_md)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    table = report_md.read_text().split("## Training step")[1]
    step = {r["impl"]: r["ms"] for r in written if r["pass"] == "step"}
    assert f"| gmoe | {step['gmoe']:.2f} |" in table and f"| torch | {step['torch']:.2f} |" in table

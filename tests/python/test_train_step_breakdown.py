"""bench/train_step_breakdown.py runs on the CPU (tiny preset) and accounts for the whole step."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import train_step_breakdown as tsb  # noqa: E402


def test_breakdown_of_both_models_on_the_cpu(tmp_path):
    out = tmp_path / "b.md"
    rows = tsb.main(["--iters", "1", "--warmup", "0", "--device", "cpu", "--steps", "4", "--layers", "1",
                     "--markdown", str(out)])
    assert [r["impl"] for r in rows] == ["gmoe", "torch"]
    for r in rows:
        assert r["step_ms"] > 0 and r["moe_ms"] > 0 and r["optimizer_ms"] > 0
        assert r["rest_ms"] == pytest.approx(r["step_ms"] - r["moe_ms"] - r["optimizer_ms"])
    text = out.read_text()
    assert "| gmoe |" in text and "| torch |" in text and "Amdahl" in text

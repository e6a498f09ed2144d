"""evals/overhead.py end to end on a small vocabulary: the json has every mode and method, sane
figures, the hf_specdec / transformers ratio of the recorded figures, and greedy identity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "evals" / "overhead.py"


def test_overhead_benchmark_end_to_end(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(SCRIPT), "--vocab", "256", "--max-new-tokens", "20", "--repeats", "1",
           "--prompt-tokens", "16", "--threads", "1", "--out", str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]

    report = json.loads((tmp_path / "overhead.json").read_text())
    config = report["config"]
    assert (config["vocab"], config["k"], config["max_new_tokens"], config["repeats"]) == (256, 5, 20, 1)
    assert config["torch_threads"] == 1 and config["transformers"] and config["torch"]
    assert set(report["modes"]) == {"greedy", "sampling"}
    for mode, entry in report["modes"].items():
        methods = entry["methods"]
        assert set(methods) == {"plain", "transformers", "hf_specdec"}
        for name, m in methods.items():
            assert m["rounds"] > 0, (mode, name)
            assert m["overhead_ms_per_round"] >= 0, (mode, name)
            assert m["tokens_per_round"] >= 1, (mode, name)
            assert len(m["runs"]) == 1 and m["runs"][0]["new_tokens"] == 20
            assert m["wall_ms"] >= m["forward_ms"] > 0
        assert methods["plain"]["tokens_per_round"] == 1  # one forward per generated token
        assert methods["plain"]["overhead_ms_per_step"] == methods["plain"]["overhead_ms_per_round"]
        assert methods["hf_specdec"]["draft_forwards"] > 0 and methods["transformers"]["draft_forwards"] > 0
        ratio = methods["hf_specdec"]["overhead_ms_per_round"] / methods["transformers"]["overhead_ms_per_round"]
        assert entry["ratio_hf_specdec_over_transformers"] == pytest.approx(ratio)
        assert entry["meets_target"] == (ratio <= config["target_ratio"])
    assert report["modes"]["greedy"]["greedy_identical"] is True

    table = (tmp_path / "overhead.md").read_text()
    assert "| greedy | hf_specdec |" in table and "| sampling | transformers |" in table
    assert "hf_specdec / transformers" in result.stdout

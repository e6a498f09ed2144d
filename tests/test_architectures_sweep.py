"""evals/architectures/sweep.py runs end to end: two model types a role, each in its own subprocess, with
the outcomes the recorded sweeps and the family refusals lead to (evals/results/architectures/sweep/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = {
    "target": {"llama": "equal", "paligemma": "refused"},  # PaliGemma: use_bidirectional_attention
    "draft": {"gpt2": "equal", "xlm": "refused"},  # XLM cuts the sequence itself: refused as a draft
    "continuous": {"llama": "equal", "mistral": "refused"},  # a sliding window cannot be gathered by rows
}


@pytest.mark.slow  # ~25 s a role: every class imports transformers in its own process
@pytest.mark.parametrize("role", sorted(EXPECTED))
def test_sweep_outcomes(role, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(ROOT / "evals/architectures/sweep.py"), "--role", role, "--only", *EXPECTED[role],
                    "--out", str(tmp_path), "--timeout", "300"], check=True, env=env, cwd=ROOT, capture_output=True)
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    got = {r["model_type"]: r["outcome"] for r in records}
    assert got == EXPECTED[role], [(r["key"], r["outcome"], r.get("note")) for r in records]
    assert all(r["outcome"] in (tmp_path / "table.md").read_text() for r in records)
    assert all(r["counts"] for r in records)

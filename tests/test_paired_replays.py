"""evals/paired_replays.py: old against new replays paired per prompt and seed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))

from paired_replays import geomean, paired  # noqa: E402


def write(folder: Path, rows: list[tuple[str, str, int, float]]) -> None:
    folder.mkdir(parents=True)
    (folder / "replay.jsonl").write_text("".join(
        json.dumps(dict(id=i, category=c, new_tokens=n, modelled_seconds=s)) + "\n" for i, c, n, s in rows))


def test_pairs_are_matched_by_prompt_and_seed_and_missing_seeds_skipped(tmp_path):
    write(tmp_path / "old" / "bf16-s0", [("a", "qa", 10, 10.0), ("b", "rag", 10, 5.0)])
    write(tmp_path / "new" / "bf16-s0", [("a", "qa", 10, 5.0), ("b", "rag", 20, 5.0), ("c", "rag", 1, 1.0)])
    write(tmp_path / "old" / "bf16-s1", [("a", "qa", 10, 10.0)])  # no new seed 1: skipped
    used, ratios = paired(tmp_path / "old", tmp_path / "new", "bf16", [0, 1])
    assert used == [0] and ratios == {"qa": [2.0], "rag": [2.0]}  # twice the rate; "c" has no old pair
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)

"""evals/regimes.py: a prompt replayed under several seeds is rated by its tokens over its modelled
seconds summed over them (a short sample path weighs what its tokens weigh), against plain's likewise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evals"))

from costs import CostTable  # noqa: E402
from regimes import medians, paired_ratios  # noqa: E402


def flat_table() -> CostTable:
    """Every forward costs 1 s whatever its width and context; positions are free."""
    return CostTable(widths=[1, 9], contexts=[0, 1000], forwards={"target": [[1.0, 1.0], [1.0, 1.0]],
                     "hf": [[0.0, 0.0], [0.0, 0.0]]}, prefills=[1, 1000], prefill={"target": [1.0, 1.0], "hf": [0.0, 0.0]},
                     position={"sampling": {"transformers": 0.0, "hf_specdec": 0.0}})


def record(prompt: str, category: str, tokens: int, forwards: int, method: str = "hf_specdec") -> dict:
    return dict(mode="sampling", id=prompt, category=category, method=method, new_tokens=tokens,
                work={"target": [[1, 10]] * forwards})


def test_several_seeds_of_a_prompt_are_pooled_before_the_median():
    table = flat_table()
    plain = {("sampling", "a"): [record("a", "qa", 10, 10, "plain"), record("a", "qa", 30, 30, "plain")],
             ("sampling", "b"): [record("b", "qa", 20, 20, "plain")]}
    # prompt a: seed 0 ends after 2 tokens in 2 forwards (1 token/s), seed 1 makes 60 tokens in 20 (3/s):
    # pooled 62 / 22 tokens a second against plain's 1/s; prompt b: 2 tokens a second
    rows = [record("a", "qa", 2, 2), record("a", "qa", 60, 20), record("b", "qa", 40, 20)]
    got = medians(rows, plain, table, "hf_specdec")["sampling"]["qa"]
    assert got == pytest.approx((62 / 22 + 2.0) / 2)
    # one seed alone is what the table said before seeds were pooled
    assert medians(rows[:1], plain, table, "hf_specdec")["sampling"]["qa"] == pytest.approx(1.0)
    # a prompt plain never ran is left out
    assert "sampling" not in medians([record("c", "qa", 5, 1)], plain, table, "hf_specdec")


def test_old_and_new_are_paired_by_seed_and_prompt():
    table = flat_table()
    old = [[record("a", "qa", 10, 10), record("b", "rag", 10, 5)], [record("a", "qa", 10, 10)]]
    new = [[record("a", "qa", 10, 5), record("b", "rag", 20, 5), record("c", "rag", 1, 1)], [record("a", "qa", 10, 20)]]
    # seed 0: a twice as fast, b twice as fast, c has no old pair; seed 1: a half as fast (not paired with seed 0)
    assert paired_ratios(old, new, table) == {"sampling": {"qa": [2.0, 0.5], "rag": [2.0]}}

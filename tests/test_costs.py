"""The evaluation's cost table, modelled time, pinned repeatability and held-out splits (issue 11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evals"))

from common import CATEGORIES, bootstrap_interval, prompt_pools, split_of, with_scored  # noqa: E402
from costs import CostTable  # noqa: E402


def hand_table() -> CostTable:
    """Round numbers: a target forward costs 1 s + 0.1 s per extra token at context 100, twice that at
    context 300; a draft forward a tenth of it; prefills 0.01 s per token; positions 1 ms / 2 ms."""
    widths, contexts = [1, 3, 9], [100, 300]
    target = [[1.0 + 0.1 * (w - 1) for w in widths], [2.0 + 0.2 * (w - 1) for w in widths]]
    return CostTable(
        widths=widths, contexts=contexts,
        forwards={"target": target, "hf": [[t / 10 for t in row] for row in target]},
        prefills=[10, 100], prefill={"target": [0.1, 1.0], "hf": [0.01, 0.1]},
        position={"greedy": {"transformers": 0.001, "hf_specdec": 0.002}},
    )


def test_a_record_priced_by_hand_equals_the_code():
    table = hand_table()
    work = {
        "target": [[50, 0], [4, 50], [1, 200]],  # prefill of 50; 4 tokens at context 50; 1 token at context 200
        "hf": [[50, 0], [2, 100]],
    }
    # target: prefill 50 -> 0.1 + 0.9 * 40/90 = 0.5; width 4 at context 50 (extrapolated below 100):
    # at 100: 1 + 0.1 * 3 = 1.3, at 300: 2 + 0.2 * 3 = 2.6, so at 50: 1.3 - 1.3 * 50/200 = 0.975;
    # width 1 at context 200: (1.0 + 2.0) / 2 = 1.5.
    # draft: prefill 50 -> 0.05; width 2 at context 100 -> (1 + 0.1) / 10 = 0.11.
    # positions: a target prefill scores 1, other target forwards their width, draft forwards 1 each:
    # 1 + 4 + 1 + 1 + 1 = 8, at 2 ms (hf_specdec) or 1 ms (transformers).
    expected = 0.5 + 0.975 + 1.5 + 0.05 + 0.11 + 8 * 0.002
    assert table.modelled_seconds(work, "greedy", "hf_specdec") == pytest.approx(expected)
    assert table.modelled_seconds(work, "greedy", "transformers") == pytest.approx(expected - 8 * 0.001)
    # with the positions each target forward scored (hf_specdec's round records) counted instead:
    # 3 + 2 + 1 as many as 1 + 4 + 1; 1 + 2 + 1 two fewer
    assert table.modelled_seconds(dict(work, scored=[3, 2, 1]), "greedy", "hf_specdec") == pytest.approx(expected)
    assert table.modelled_seconds(dict(work, scored=[1, 2, 1]), "greedy", "hf_specdec") == pytest.approx(expected - 2 * 0.002)


def test_scored_positions_are_taken_per_round_from_the_records():
    from types import SimpleNamespace as R
    work = {"target": [[50, 0], [4, 50]], "hf": [[50, 0]]}
    rounds = [R(round=0, scored=1), R(round=1, scored=4), R(round=1, scored=2)]  # round 1: two rows, the batch's most
    assert with_scored(work, rounds) == dict(work, scored=[1, 4])
    assert with_scored(work, rounds[:1]) == work  # rounds and forwards do not pair: left as it was


def test_pinned_costs_and_drift_from_the_table():
    table = hand_table()
    costs = table.pinned_costs(100)["costs"]
    assert costs.draft_step == pytest.approx(0.1)
    # every width's price up to the widest measured, over the step (interpolated between grid widths)
    assert costs.verify == pytest.approx([1.0 + 0.1 * (w - 1) for w in range(1, 10)])  # 0.1 s a token over a 1 s step
    assert costs.draft_prefill == pytest.approx(0.1 / 100 / 1.0)  # the draft's 100-token prefill per token
    dip = hand_table()
    dip.forwards["target"][0][1] = 0.8  # 3 tokens cheaper than 1 at context 100: the curve shows it
    assert dip.pinned_costs(100)["costs"].verify[:3] == pytest.approx([1.0, 0.9, 0.8])
    # with a mode, each scored position's processing is priced as modelled_seconds prices it:
    # a step is 1 s + 2 ms, a forward over w tokens 1 + 0.1 (w - 1) s + w * 2 ms, a draft step 0.1 s + 2 ms
    greedy = table.pinned_costs(100, mode="greedy")["costs"]
    assert greedy.verify[:3] == pytest.approx([1.0, 1.104 / 1.002, 1.206 / 1.002], abs=1e-4)  # rounded to 4 places
    assert greedy.draft_step == pytest.approx(0.102 / 1.002)
    assert greedy.position == 0.0  # greedy scores every position: nothing for the planner to save
    sampled = hand_table()
    sampled.position["sampling"] = {"transformers": 0.05, "hf_specdec": 0.1}
    assert sampled.pinned_costs(100, mode="sampling")["costs"].position == pytest.approx(0.1 / 1.1, abs=1e-4)
    other = hand_table()
    other.forwards["target"][1][2] *= 1.25
    assert table.drift(other) == pytest.approx(0.25)


def test_the_table_round_trips_through_json(tmp_path):
    table = hand_table()
    table.save(tmp_path / "t.json")
    assert CostTable.load(tmp_path / "t.json") == table


def test_the_split_is_disjoint_stable_and_covers_every_category():
    assert split_of("81") == "report" and split_of("82") == "tuning"
    assert split_of("HumanEval/2") == "tuning" and split_of("HumanEval/163") == "report"
    everything = prompt_pools(CATEGORIES, "all")
    tuning, report = prompt_pools(CATEGORIES, "tuning"), prompt_pools(CATEGORIES, "report")
    for category in CATEGORIES:
        ids = [i for i, _ in everything[category]]
        t, r = {i for i, _ in tuning[category]}, {i for i, _ in report[category]}
        assert not t & r and t | r == set(ids)
        assert len(t) >= 5 and len(r) >= 5  # the standard preset's 5 prompts per category fit in either
    assert prompt_pools(CATEGORIES, "report") == report  # stable: the same on a second call


def test_bootstrap_interval_brackets_the_statistic_and_narrows_with_more_prompts():
    import statistics

    few = [[1.0, 2.0, 3.0, 4.0, 5.0]]
    many = [[1.0, 2.0, 3.0, 4.0, 5.0] * 20]
    median = lambda groups: statistics.median(groups[0])  # noqa: E731
    lo, hi = bootstrap_interval(few, median)
    assert lo <= 3.0 <= hi
    lo2, hi2 = bootstrap_interval(many, median)
    assert hi2 - lo2 < hi - lo
    assert bootstrap_interval(few, median) == (lo, hi)  # seeded: the same interval twice


def eval_run(out: Path, table: Path) -> list[dict]:
    cmd = [sys.executable, str(ROOT / "evals" / "run_eval.py"), "--target", "tiny", "--draft", "tiny",
           "--prompts-per-category", "1", "--max-new-tokens", "24", "--categories", "qa", "humaneval",
           "--modes", "greedy", "--methods", "plain", "hf_specdec", "--threads", "1",
           "--cost-table", str(table), "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_with_a_pinned_table_a_greedy_run_repeats_tokens_rounds_and_modelled_time(tmp_path):
    """A cheap draft in the table makes hf_specdec's cost model draft adaptively (lengths vary); with
    the table pinned, its decisions read no clock, so a second run makes the same decisions."""
    table = hand_table()
    table.position["sampling"] = table.position["greedy"]
    table.forwards["bf16"], table.prefill["bf16"] = table.forwards["hf"], table.prefill["hf"]  # the unquantized draft
    table.save(tmp_path / "table.json")
    first, second = eval_run(tmp_path / "a", tmp_path / "table.json"), eval_run(tmp_path / "b", tmp_path / "table.json")
    spec = [r for r in first if r["method"] == "hf_specdec"]
    assert len({d for r in spec for d, _, _ in r["round_log"]}) > 1, "the cost model never varied the draft length"
    for a, b in zip(first, second):
        assert (a["id"], a["method"]) == (b["id"], b["method"])
        assert a["tokens"] == b["tokens"] and a["work"] == b["work"]
        assert a["modelled_seconds"] == b["modelled_seconds"]
        if a["method"] == "hf_specdec":
            assert a["round_log"] == b["round_log"] and a["rounds"] == b["rounds"]


def test_positions_are_priced_with_the_processors_generate_builds():
    """generate(do_sample=True, temperature, top_p) also applies top-k 50 (transformers' default): the
    position pickers take their processors from generate() itself, so a price is timed with what the
    calls ran (the standard preset's "sampling" row was once timed without that top-k)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    from costs import generate_processors, position_pickers, position_seconds

    model = tiny_model("llama", vocab=64)
    as_called = generate_processors(model, dict(do_sample=True, temperature=0.7, top_p=0.95))
    assert [p.top_k for p in as_called if isinstance(p, TopKLogitsWarper)] == [50]
    assert any(isinstance(p, TopPLogitsWarper) for p in as_called)
    unset = generate_processors(model, dict(do_sample=True, temperature=0.7, top_p=0.95, top_k=0))
    assert not any(isinstance(p, TopKLogitsWarper) for p in unset)
    pickers = position_pickers(model, dict(do_sample=True, temperature=0.7, top_k=3))
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for pick in pickers.values():  # each engine draws among the 3 highest only
        assert all(int(pick(row[None])) in row.topk(3).indices.tolist() for row in logits for _ in range(5))
    timed = position_seconds(pickers, 64, "cpu", reps=4, logits=logits)
    assert set(timed) == {"transformers", "hf_specdec"} and all(s > 0 for s in timed.values())

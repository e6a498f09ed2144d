"""evals/gpu_run.sh and its parts on a machine without a GPU (issue 41): the dry run starts and stops
cleanly, the hand-written accelerator regime is what it says, and the replay summarises correctly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_specdec.stats import RoundRecord

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evals"))

import gpu_costs  # noqa: E402
import replay  # noqa: E402
from costs import CostTable  # noqa: E402


def test_gpu_run_dry_run_prints_its_plan_and_exits_0(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would run for real")
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "evals" / "gpu_run.sh"), str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert "dry run" in run.stdout and "evals/gpu_costs.py" in run.stdout
    for name in ("qwen2.5-coder-1.5b-instruct.json: Qwen2ForCausalLM, 1.78 B", "qwen2.5-coder-0.5b-instruct.json"):
        assert name in run.stdout  # the real pair's configs build (on the meta device)
    assert not list((tmp_path / "out").glob("**/*.json")), "a dry run measures nothing"


def test_the_handwritten_regime_is_flat_to_64_tokens_with_a_draft_at_0_6():
    table = gpu_costs.handwritten_table()
    step = table.forward("target", 1, 256)
    assert all(table.forward("target", w, c) == pytest.approx(step) for w in (1, 9, 33, 64) for c in (64, 1024))
    assert table.forward("target", 128, 256) > step
    costs = table.pinned_costs(200, "hf", 64)["costs"]
    assert costs.draft_step == pytest.approx(0.6) and costs.verify[:64] == tuple([1.0] * 64)


def test_replay_summary_prices_every_method_with_one_table():
    table = CostTable(widths=[1, 64], contexts=[1, 4096], forwards={"target": [[1.0, 1.0]] * 2, "hf": [[0.5, 0.5]] * 2},
                      prefills=[1, 4096], prefill={"target": [1.0, 1.0], "hf": [0.5, 0.5]},
                      position={"greedy": {"transformers": 0.0, "hf_specdec": 0.0}})
    plain_work = {"target": [[5, 0]] + [[1, 5 + i] for i in range(7)]}  # 8 forwards, 8 tokens
    records = [dict(id="1", category="qa", mode="greedy", method="plain", new_tokens=8, work=plain_work),
               dict(id="1", category="qa", mode="greedy", method="prompt_lookup", new_tokens=8,
                    work={"target": [[5, 0], [4, 5], [4, 9]]})]  # 3 forwards
    replayed = [dict(id="1", category="qa", mode="greedy", method="hf_specdec", new_tokens=8, same_as_plain=True,
                     work={"target": [[5, 0], [4, 5]], "hf": [[5, 0], [1, 5], [1, 6]]},  # 2 + 3 x 0.5 = 3.5
                     choices={"draft": 1, "lookup": 0, "tree with draft": 0, "lookup tree": 0, "plain": 1})]
    text, summary = replay.summarize(records, replayed, table)
    assert summary["greedy"]["per_category"]["prompt_lookup"]["qa"] == pytest.approx(8 / 3)
    assert summary["greedy"]["per_category"]["hf_specdec"]["qa"] == pytest.approx(8 / 3.5)
    assert summary["greedy"]["choices"]["draft"] == pytest.approx(0.5)
    assert "Greedy outputs equal to the recorded plain greedy: 1/1" in text


def test_replay_names_each_round_by_what_it_verified():
    def record(source, drafts, parents=None):
        return RoundRecord(round=0, row=0, draft_tokens=drafts, num_accepted=0, emitted_tokens=[1], source=source,
                           parents=parents)

    rounds = [record("draft", [1, 2]), record("ngram", [3]), record("none", []), record("draft", [1, 2], [-1, 0]),
              record("ngram", [4, 5], [-1, -1])]
    assert replay.choices(rounds) == {"draft": 1, "lookup": 1, "tree with draft": 1, "lookup tree": 1, "plain": 1}


@pytest.mark.slow  # ~20 s: every check of the device script, small, on the CPU
def test_cuda_checks_dry_run(tmp_path):
    import cuda_checks

    assert cuda_checks.main(["--dry-run", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "checks.md").exists()


def test_mean_of_two_cost_tables_is_elementwise(tmp_path):
    from costs import CostTable

    one, two = gpu_costs.handwritten_table(step=0.01), gpu_costs.handwritten_table(step=0.03, draft_ratio=0.5)
    for name, table in (("a.json", one), ("b.json", two)):
        table.save(tmp_path / name)
    mean = gpu_costs.main(["--mean", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m")])
    assert mean.forward("target", 5, 256) == pytest.approx(0.02)
    assert mean.forward("bf16", 1, 64) == pytest.approx((0.006 + 0.015) / 2)
    assert CostTable.load(tmp_path / "m" / "cost_table.json").prefill == mean.prefill
    other = gpu_costs.handwritten_table()
    other.widths = other.widths[:-1]
    with pytest.raises(ValueError, match="different grids"):
        CostTable.mean([one, other])

"""evals/repetition.py (issue 39) on tiny models: a shared RetrievalCache is verified from the second
sample of a prompt on, the modelled speedup is priced, and pass@k is the unbiased estimator."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import perturbed, tiny_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evals"))

from costs import CostTable  # noqa: E402
from regimes import lookup_work  # noqa: E402
from repetition import lookup_on_outputs, pass_at_k, passes, plain_work, price, program, report, run_all  # noqa: E402


def hand_table() -> CostTable:
    """A target forward 1 s + 0.1 s per extra token at context 100, twice that at 300; the draft a tenth;
    prefills 0.01 s a token; a sampled position 1 ms (transformers) or 2 ms (hf_specdec)."""
    widths, contexts = [1, 3, 9], [100, 300]
    target = [[1.0 + 0.1 * (w - 1) for w in widths], [2.0 + 0.2 * (w - 1) for w in widths]]
    return CostTable(widths=widths, contexts=contexts,
                     forwards={"target": target, "hf": [[t / 10 for t in row] for row in target]},
                     prefills=[10, 100], prefill={"target": [0.1, 1.0], "hf": [0.01, 0.1]},
                     position={"sampling": {"transformers": 0.001, "hf_specdec": 0.002}})


def test_a_shared_cache_is_verified_from_the_second_sample_and_the_speedup_is_priced(tmp_path):
    target = tiny_model("llama", seed=1)
    draft = perturbed(target, 0.5)
    prompts = {"self_consistency": [dict(id="7", input_ids=[1, 5, 2, 7, 9, 4]), dict(id="9", input_ids=[3, 8, 2, 7])]}
    records, runs = run_all(target, draft, None, prompts, {"hand": hand_table()}, samples=2, max_new_tokens=24)
    assert len(records) == 2 * 2 * 2 and [r["method"] for r in runs] == ["hf_specdec", "hf_specdec+cache"]
    alone = [r for r in records if r["method"] == "hf_specdec"]
    cached = [r for r in records if r["method"] == "hf_specdec+cache"]
    assert all(r["cache_rounds"] == 0 for r in alone)
    assert cached[0]["cache_rounds"] == 0 and sum(r["cache_rounds"] for r in cached if r["sample"] == 1) > 0
    assert runs[1]["cache_tokens"] > 2 * 24 and runs[1]["cache_bytes"] > 0 and runs[0]["cache_tokens"] is None
    text, rows = report(records, runs, {"hand": "hand.json"}, "python evals/repetition.py")
    assert rows[1]["speedup"]["hand"] > 0 and rows[1]["median_speedup"]["hand"] > 0 and rows[1]["cache_round_share"] > 0
    assert "| self_consistency | hf_specdec+cache |" in text
    # plain's work: a prefill, then one token at a time over the growing context
    assert plain_work(6, 3) == {"target": [[6, 0], [1, 6], [1, 7]]}
    # --lookup-on: transformers' prompt lookup priced on the same outputs, pooled per workload and method
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = lookup_on_outputs(tmp_path, prompts, {"hand": hand_table()}, target, 24)
    ids = {p["id"]: p["input_ids"] for p in prompts["self_consistency"]}
    lookup = sum(hand_table().modelled_seconds(lookup_work(ids[r["id"]], r["tokens"], "sampling", [], 64, 24, (0.7, 1.0)),
                                               "sampling", "transformers") for r in cached)
    plain = sum(price(r, hand_table())[1] for r in cached)
    ours = sum(price(r, hand_table())[0] for r in cached)
    assert f"| self_consistency | hf_specdec+cache | {plain / ours:.2f} | {plain / lookup:.2f} |" in text


def test_pass_at_k_and_the_program_built_from_an_answer():
    assert pass_at_k(8, 0, 1) == 0 and pass_at_k(8, 0, 8) == 0
    assert pass_at_k(8, 8, 1) == 1 and pass_at_k(8, 1, 8) == 1
    assert pass_at_k(8, 1, 1) == pytest.approx(0.125) and pass_at_k(8, 2, 2) == pytest.approx(1 - 15 / 28)
    problem = dict(prompt="def f(x):\n    \"\"\"Twice x.\"\"\"\n", entry_point="f",
                   test="def check(candidate):\n    assert candidate(2) == 4\n")
    # the problem's prompt continued (the harness's way): cut at the stop sequences
    continued = program(problem, "    return 2 * x\n\ndef g():\n    pass\nprint(f(1))\n")
    assert "def g" not in continued and "print(" not in continued and continued.endswith("check(f)\n")
    assert "Done" not in program(problem, "    return 2 * x\n```\nDone.")
    # a chat answer: the code of its first fenced block, cut after the function it restates
    restated = program(problem, "Sure:\n```python\ndef f(x):\n    return x + x\n\nprint(f(3))\n```\nDone.", chat=True)
    assert "return x + x" in restated and "print(" not in restated and "Done" not in restated
    assert passes(continued) and passes(restated)
    assert not passes(program(problem, "    return x\n")) and not passes(program(problem, "    while True:\n        pass\n"), 2)


@pytest.mark.parametrize("exit_call", ["exit(0)", "import sys\nsys.exit(0)", "import os\nos._exit(0)"])
def test_a_completion_that_exits_before_the_check_does_not_pass(exit_call):
    """The program exits 0 at top level, after the function and before check() runs: no pass (the
    exit code alone had counted it as one)."""
    problem = dict(prompt="def f(x):\n    \"\"\"Twice x.\"\"\"\n", entry_point="f",
                   test="def check(candidate):\n    assert candidate(2) == 4\n")
    assert not passes(program(problem, f"    return x\n{exit_call}\n"))
    assert passes(program(problem, "    return 2 * x\n"))


def test_a_forked_child_neither_holds_the_run_up_nor_outlives_it(tmp_path):
    """A passing program whose forked child sleeps on: the pass is counted when the program exits,
    and the child is killed with its process group (it held the output pipe until the timeout, and
    then ran on: no pass, and a stray process)."""
    import os
    import time

    if not hasattr(os, "fork"):
        pytest.skip("no fork")
    problem = dict(prompt="def f(x):\n", entry_point="f", test="def check(candidate):\n    assert candidate(2) == 4\n")
    pid_file = tmp_path / "child.pid"
    fork = ("    return 2 * x\nimport os, time\nif os.fork() == 0:\n"
            f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n    time.sleep(8)\n    os._exit(0)\ntime.sleep(0.5)\n")
    start = time.monotonic()
    assert passes(program(problem, fork), timeout=4)
    assert time.monotonic() - start < 3.5
    stat = Path(f"/proc/{pid_file.read_text()}/stat")
    time.sleep(0.2)
    try:  # gone, or a zombie waiting for its new parent to reap it
        assert stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        pass


def test_the_wall_clock_ways_count_each_rows_tokens_to_its_eos_and_rate_against_plain():
    """evals/repetition_wall.py: plain, hf_specdec and hf_specdec+cache as n rows of one call, and the
    stream through generate_continuous, interleaved; tokens counted per row through its first EOS."""
    import argparse

    import torch
    from repetition_wall import row_tokens, run, summary

    assert row_tokens(torch.tensor([[5, 2, 9, 9], [4, 4, 4, 4]]), {2}) == [[5, 2], [4, 4, 4, 4]]
    target = tiny_model("llama", seed=1)
    draft = perturbed(target, 0.5)
    prompts = {"self_consistency": [dict(id="7", input_ids=[1, 5, 2, 7, 9, 4])]}
    args = argparse.Namespace(samples=3, max_new_tokens=12, reps=2, seed=0, continuous=True, no_execute=True)
    records = run(target, draft, None, prompts, args, lambda r: None)
    methods = [r["method"] for r in records]
    assert methods[:4] == ["plain", "hf_specdec", "hf_specdec+cache", "continuous"]
    assert methods[4:] == ["hf_specdec", "hf_specdec+cache", "continuous", "plain"]  # rotated
    assert all(r["rows"] == 3 and 3 <= r["new_tokens"] <= 36 and r["seconds"] > 0 for r in records)
    text, rows = summary(records)
    plain = next(r for r in rows if r["method"] == "plain")
    assert plain["speedup"] == 1.0 and all(r["speedup"] > 0 and r["low"] <= r["high"] for r in rows)
    assert "| self_consistency | continuous |" in text


def test_a_workloads_own_position_row_prices_its_positions_and_is_pinned():
    """A table with a row for the workload (`--measure-positions`) prices that workload's positions with
    it, plain's and hf_specdec's, and pins it as Costs.position; other workloads keep the "sampling" row."""
    from repetition import WORKLOADS, position_mode

    table = hand_table()
    record = dict(workload="pass_at_k", prompt_tokens=100, new_tokens=3,
                  work={"target": [[100, 0], [3, 100]], "hf": [[1, 100], [1, 101]]})
    before = price(record, table)
    table.position["pass_at_k"] = {"transformers": 0.101, "hf_specdec": 0.202}
    after = price(record, table)
    assert position_mode(table, "pass_at_k") == "pass_at_k" and position_mode(table, "self_consistency") == "sampling"
    plain_positions, our_positions = 3, 1 + 3 + 2  # plain: one per token; ours: the prefill's, 3 verified, 2 drafted
    assert after[1] - before[1] == pytest.approx(plain_positions * 0.1)
    assert after[0] - before[0] == pytest.approx(our_positions * 0.2)
    assert price(dict(record, workload="self_consistency"), table) == before
    pinned = table.pinned_costs(100, "hf", 256, "pass_at_k")["costs"]
    assert pinned.position == pytest.approx(0.202 / (1.0 + 0.202), abs=1e-4)
    assert table.pinned_costs(100, "hf", 256)["costs"].position == 0.0  # no mode: positions unpriced
    # the sampling arguments are all named: top-k 50, which generate() would otherwise add unasked
    assert WORKLOADS["pass_at_k"].sampling() == dict(do_sample=True, temperature=0.8, top_p=0.95, top_k=50)


def test_the_sequential_wall_clock_way_interleaves_one_row_calls_and_pairs_them_by_sample():
    """evals/repetition_wall.py --sequential: each sample its own one-row call of each method, their
    order rotating; the cache is shared by every call; speedups paired per sample."""
    import argparse
    import math

    from repetition_wall import main, paired, run_sequential, summary

    with pytest.raises(SystemExit):  # two shapes at once: refused before any model loads
        main(["--out", "unused", "--sequential", "--continuous"])
    with pytest.raises(SystemExit):  # a draft precision the CLI has no quantizer for
        main(["--out", "unused", "--sequential", "--draft-bits", "5"])

    target = tiny_model("llama", seed=1)
    draft = perturbed(target, 0.5)
    prompts = {"self_consistency": [dict(id="7", input_ids=[1, 5, 2, 7, 9, 4])]}
    args = argparse.Namespace(samples=2, max_new_tokens=12, seed=0, no_execute=True)
    records = run_sequential(target, draft, None, prompts, args, lambda r: None)
    assert [r["method"] for r in records] == ["plain", "hf_specdec", "hf_specdec+cache",
                                               "hf_specdec", "hf_specdec+cache", "plain"]
    assert [r["sample"] for r in records] == [0, 0, 0, 1, 1, 1] and all(r["rows"] == 1 for r in records)
    text, rows = summary(records)
    assert "per sample, geometric mean" in text
    ratios = [(r["new_tokens"] / r["seconds"]) / (p["new_tokens"] / p["seconds"])
              for r in records if r["method"] == "hf_specdec"
              for p in records if p["method"] == "plain" and p["sample"] == r["sample"]]
    assert paired(records, "hf_specdec").startswith(f"{math.exp(sum(map(math.log, ratios)) / 2):.2f}x [")

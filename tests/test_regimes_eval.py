"""evals/regimes.py: a prompt replayed under several seeds is rated by its tokens over its modelled
seconds summed over them (a short sample path weighs what its tokens weigh), against plain's likewise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evals"))

import random  # noqa: E402

import torch  # noqa: E402

from common import MODES, ForwardTimer  # noqa: E402
from conftest import tiny_model  # noqa: E402
from costs import CostTable  # noqa: E402
from regimes import (  # noqa: E402
    KS, expected_chain_seconds, greedy_chain_work, lookup_work, medians, paired_ratios, plain_work,
)


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


def width_table() -> CostTable:
    """A forward's price grows with its width and context, a draft step costs a tenth of the target's."""
    return CostTable(widths=[1, 9, 64], contexts=[0, 1000], forwards={"target": [[1.0, 1.5], [1.3, 2.0], [3.0, 4.0]],
                     "hf": [[0.1, 0.15], [0.2, 0.3], [0.5, 0.6]]}, prefills=[1, 1000], prefill={"target": [1.0, 9.0], "hf": [0.1, 1.0]},
                     position={"sampling": {"transformers": 0.01, "hf_specdec": 0.02}})


def test_expected_chain_seconds_is_the_chain_work_averaged_over_acceptance_patterns():
    table = width_table()
    price = lambda model, width, context: table.modelled_seconds({model: [[width, context]]}, "sampling", "hf_specdec")  # noqa: E731
    rng = random.Random(0)
    for _ in range(50):  # certain acceptances: exactly the pattern's work
        n, prompt, k = rng.randint(1, 64), rng.randint(5, 400), rng.choice(KS)
        agree = [rng.random() < 0.6 for _ in range(n)]
        exact = table.modelled_seconds(greedy_chain_work(prompt, 256, agree, k, 64), "sampling", "hf_specdec")
        assert expected_chain_seconds(prompt, 256, [float(a) for a in agree], k, 64, price) == pytest.approx(exact)
        lazy = table.modelled_seconds(greedy_chain_work(prompt, 256, agree, k, 64, lazy=True), "sampling", "hf_specdec")
        assert expected_chain_seconds(prompt, 256, [float(a) for a in agree], k, 64, price, 0.02) == pytest.approx(lazy)
    # uncertain ones: the mean over 4,000 drawn patterns (standard error about 0.1% here; 0.5% allowed)
    accept = [rng.random() for _ in range(40)]
    draws = [table.modelled_seconds(greedy_chain_work(80, 256, [rng.random() < a for a in accept], 4, 64), "sampling",
                                    "hf_specdec") for _ in range(4000)]
    assert expected_chain_seconds(80, 256, accept, 4, 64, price) == pytest.approx(sum(draws) / len(draws), rel=0.005)
    # and not the work of always or never accepting
    assert expected_chain_seconds(80, 256, [1.0] * 40, 4, 64, price) < sum(draws) / len(draws) < \
        expected_chain_seconds(80, 256, [0.0] * 40, 4, 64, price)
    # the positions the lazy rule scores (sampling on a CPU), which cut the price of k = 6 and 8 chains
    position = table.position["sampling"]["hf_specdec"]
    for k in (4, 8):
        lazy = [table.modelled_seconds(greedy_chain_work(80, 256, [rng.random() < a for a in accept], k, 64, lazy=True),
                                       "sampling", "hf_specdec") for _ in range(4000)]
        mean = sum(lazy) / len(lazy)
        assert expected_chain_seconds(80, 256, accept, k, 64, price, position) == pytest.approx(mean, rel=0.005)
        assert mean < expected_chain_seconds(80, 256, accept, k, 64, price) * (0.999 if k == 8 else 1.0)


def test_given_the_output_a_drafted_token_was_kept_with_chance_min_p_q_over_p():
    """The premise of `acceptance_on_path`: one position of the rule (draft x ~ q, keep it with chance
    min(1, p(x)/q(x)), else draw from max(0, p - q)), 400,000 times; per output y the share of rounds
    that kept the draft is min(p(y), q(y)) / p(y) to within 0.01 (at least 8,000 draws per y: standard
    error under 0.006), and differs from the unconditional chance sum min(p, q) where they differ."""
    gen = torch.Generator().manual_seed(0)
    p, q = torch.rand(6, generator=gen).softmax(0), (2 * torch.rand(6, generator=gen)).softmax(0)
    n = 400_000
    x = torch.multinomial(q, n, replacement=True, generator=gen)
    keep = torch.rand(n, generator=gen) < (p[x] / q[x]).clamp(max=1)
    residual = (p - q).clamp(min=0)
    y = torch.where(keep, x, torch.multinomial(residual / residual.sum(), n, replacement=True, generator=gen))
    unconditional = torch.minimum(p, q).sum().item()  # the broken variant: the chance not given the output
    for token in range(6):
        drawn = y == token
        assert drawn.sum() > 8000
        assert keep[drawn].float().mean().item() == pytest.approx((torch.minimum(p, q)[token] / p[token]).item(), abs=0.01)
    # which this test tells apart: it is off by more than 0.05 at some token, 5x the tolerance
    assert max(abs(keep[y == t].float().mean().item() - unconditional) for t in range(6)) > 0.05


@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_prompt_lookup_rounds_follow_from_its_output(mode):
    """transformers' prompt lookup on a tiny model: every forward it ran (width, cached tokens) is what
    `lookup_work` derives from the output alone; plain decoding's likewise from `plain_work`."""
    model = tiny_model("llama", vocab=64, init=0.6)
    timer = ForwardTimer(model)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6]])
    kept = False
    for seed in range(3):
        for method, kwargs in (("lookup", dict(prompt_lookup_num_tokens=10)), ("plain", {})):
            timer.take_with_work()
            torch.manual_seed(seed)
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40, **MODES[mode], **kwargs)
            tokens = out[0, prompt.shape[1]:].tolist()
            forwards = timer.take_with_work()[1]
            if method == "plain":
                assert forwards == plain_work(prompt.shape[1], len(tokens))["target"]
                continue
            derived = lookup_work(prompt[0].tolist(), tokens, mode, [], 64, 40)["target"]
            assert derived == forwards
            assert any(w > 1 for w, _ in forwards[1:])  # lookups happened
            kept |= any(after[1] - before[1] > 1 for before, after in zip(forwards[1:], forwards[2:]))
    assert kept  # and some of their tokens were kept


def test_records_that_are_not_run_eval_records_are_named(tmp_path):
    """Before: replay.py and regimes.py met a bad --records file with json's raw error or a KeyError."""
    from regimes import read_records

    (tmp_path / "a.jsonl").write_text("not json\n{}\n")
    (tmp_path / "b.jsonl").write_text('{"id": 1}\n')
    with pytest.raises(SystemExit, match="--records .*a.jsonl:1: not a JSON record"):
        read_records(tmp_path / "a.jsonl")
    with pytest.raises(SystemExit, match="b.jsonl:1: not a record of run_eval.py"):
        read_records(tmp_path / "b.jsonl")
    (tmp_path / "c.jsonl").write_text('{"id": 1, "category": "qa", "mode": "greedy", "method": "plain", "work": "[1]"}\n')
    assert read_records(tmp_path / "c.jsonl")[0]["work"] == [1]

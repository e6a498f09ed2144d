"""The oracle bound of evals/repetition_bound.py: its dynamic program on hand-checked cases."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "evals"))

from repetition_bound import least_cost, run_of  # noqa: E402

FLAT = lambda width: 1.0  # noqa: E731  # a forward costs one step at any width (memory-bound)


def test_a_draft_that_is_never_accepted_leaves_plain_steps():
    assert least_cost([0.0] * 5, None, FLAT, draft_step=0.1) == pytest.approx(5.0)


def test_an_always_accepted_draft_takes_the_longest_chain_that_fits():
    # n = 3: one round of k = 2 (0.2 for the draft, 1 for the forward) emits all three tokens
    assert least_cost([1.0] * 3, None, FLAT, draft_step=0.1) == pytest.approx(1.2)


def test_a_retrieved_run_is_verified_in_one_forward_without_the_draft():
    assert least_cost([0.0] * 3, [2, 1, 0], FLAT, draft_step=0.1) == pytest.approx(1.0)


def test_an_extension_needs_the_chain_it_follows_to_be_accepted():
    # the run (3 tokens) is retrieved only after the first token: a draft of 1 then the run (extend)
    accept, runs, price = [0.5, 0.0, 0.0, 0.0, 0.0], [0, 3, 0, 0, 0], lambda w: 1.0 + 0.01 * (w - 1)
    chains = least_cost(accept, runs, price, 0.1, kinds=())
    extended = least_cost(accept, runs, price, 0.1, kinds=("extend",))
    assert extended < chains
    # by hand: k = 1 then the run: 0.1 + price(5) + (0.5 * cost after 1 token + 0.5 * nothing left)
    after_one = least_cost(accept[1:], runs[1:], price, 0.1, kinds=())
    assert extended == pytest.approx(min(chains, 0.1 + price(5) + 0.5 * after_one))


def test_more_kinds_of_round_never_cost_more():
    rng = random.Random(0)
    for _ in range(20):
        n = 30
        accept = [rng.random() for _ in range(n)]
        runs = [rng.choice([0, 0, 1, 2, 5]) for _ in range(n)]
        price = lambda w: 1.0 + 0.05 * (w - 1)  # noqa: E731
        plain, draft = float(n), least_cost(accept, None, price, 0.3)
        chains = least_cost(accept, runs, price, 0.3, kinds=())
        both = least_cost(accept, runs, price, 0.3, kinds=("tree", "extend"))
        assert plain >= draft - 1e-9 and draft >= chains - 1e-9 and chains >= both - 1e-9


def test_run_of_counts_the_matching_prefix():
    assert run_of([1, 2, 3], [1, 2, 4, 5]) == 2 and run_of([], [1]) == 0 and run_of([9], [1]) == 0

"""hf_specdec.diagnostics on hand-built tensors: where two greedy outputs part, and the top-two margin."""

from __future__ import annotations

import math

import torch

from hf_specdec.diagnostics import Divergence, bf16_step, first_divergence, greedy_divergence, top_two_margin


def test_first_divergence():
    a = torch.tensor([5, 6, 7, 8])
    assert first_divergence(a, a.clone()) is None
    assert first_divergence(a, torch.tensor([5, 6, 9, 8])) == 2
    assert first_divergence(a, torch.tensor([4, 6, 7, 8])) == 0
    # One output a proper prefix of the other: they part where the shorter one stopped.
    assert first_divergence(a, a[:3]) == 3
    assert first_divergence(a[:2], a) == 2
    assert first_divergence(torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)) is None


def test_top_two_margin_and_an_exact_tie():
    assert top_two_margin(torch.tensor([1.0, 3.0, 2.5, -4.0])) == 0.5
    assert top_two_margin(torch.tensor([2.0, 7.0, 7.0])) == 0.0  # tied top two, whatever else
    assert top_two_margin(torch.tensor([math.inf, math.inf, 2.0])) == 0.0  # was NaN (inf - inf)
    # Distinct in float32, equal once rounded to bf16 (8 bits of mantissa): the case greedy meets.
    scores = torch.tensor([20.0, 20.03, -1.0]).to(torch.bfloat16)
    assert top_two_margin(scores) == 0.0


def test_greedy_divergence_reports_position_and_plain_margin_there():
    reference = torch.tensor([3, 1, 2])
    scores = [torch.tensor([0.0, 0.0, 1.0, 4.0]),  # (vocab,) at generated token 0: argmax 3
              torch.tensor([0.0, 2.0, 2.0, 0.0]),  # token 1: tokens 1 and 2 tied
              torch.tensor([0.0, 0.0, 5.0, 1.0])]
    assert greedy_divergence(reference, reference.clone(), scores) is None
    tie = greedy_divergence(reference, torch.tensor([3, 2, 2]), scores)
    assert tie == Divergence(position=1, margin=0.0, top=2.0) and tie.exact_tie and tie.margin_in_bf16_steps == 0.0
    assert "generated token 1" in tie.describe() and "exact tie" in tie.describe()
    clear = greedy_divergence(reference, torch.tensor([3, 1, 3]), scores)
    assert clear == Divergence(position=2, margin=4.0, top=5.0) and not clear.exact_tie
    assert clear.margin_in_bf16_steps == 4.0 / bf16_step(5.0) == 128.0  # 5.0 lies in [4, 8): steps of 2^-5
    assert "4.0000" in clear.describe() and "tie" not in clear.describe()
    # The other output runs past plain's last token: no score there, so no margin.
    longer = greedy_divergence(reference, torch.tensor([3, 1, 2, 0]), scores)
    assert longer == Divergence(position=3, margin=None) and longer.margin_in_bf16_steps is None
    assert longer.describe() == "first difference at generated token 3"


def test_bf16_step_is_the_spacing_of_bf16_numbers():
    """One bf16 step at the logit sizes the issue measured (0.125 at 20.7, 0.0625 at 14.8), checked
    against torch's own next bf16 number."""
    for value in (20.7, 14.8, 1.0, 0.75, -3.3):
        x = torch.tensor(value, dtype=torch.bfloat16)
        step = float(torch.nextafter(x.abs(), torch.tensor(1e4, dtype=torch.bfloat16)) - x.abs())
        assert bf16_step(value) == step


def test_transformers_shapes_and_lists_are_taken_and_bad_shapes_named():
    """Before: out.sequences rows ([1, n]), out.scores entries ([1, vocab]) and lists met raw ValueError,
    IndexError or AttributeError; all -inf scores gave a NaN margin."""
    import pytest

    assert first_divergence(torch.tensor([[5, 6, 7]]), [5, 6, 9]) == 2
    assert top_two_margin(torch.tensor([[1.0, 3.0, 2.5]])) == 0.5
    scores = [torch.tensor([[0.0, 2.0, 1.0]])] * 3
    got = greedy_divergence(torch.tensor([[1, 1, 1]]), torch.tensor([[1, 0, 1]]), scores)
    assert got.position == 1 and got.margin == 1.0
    assert top_two_margin(torch.full((4,), float("-inf"))) == 0.0  # nothing to choose between: a tie
    with pytest.raises(ValueError, match=r"reference must be one row: shape \(n,\) or \(1, n\), got \(2, 3\)"):
        first_divergence(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="at least two entries"):
        top_two_margin(torch.tensor([1.0]))

"""Sources of one's own (`candidate_generator=`): a `Drafter` subclass or a transformers `CandidateGenerator`
is checked each round (`hf_specdec.proposals.checked`). Before, the loop verified whatever it was given:
an unnormalized q, a token q gives 0 or a host copy longer than the tokens changed the sampled law
without a word, and other mistakes met raw errors deep in torch."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.candidate_generator import CandidateGenerator

import hf_specdec
from conftest import tiny_model
from hf_specdec.proposals import Drafter, Proposal

PROMPT = torch.tensor([[1, 5, 9, 13, 5, 9, 22, 7]])


class Fn(Drafter):
    """A source whose proposal is `fn(request)`."""

    def __init__(self, fn, room=None):
        self.fn, self._room = fn, room

    def propose(self, request):
        return self.fn(request)

    def room(self, longest):
        return self._room


def one_hot(token: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.nn.functional.one_hot(torch.tensor([[token]]), 64).float()


BAD = {
    "an unnormalized q": (lambda r: Proposal(torch.tensor([[58]]), one_hot(58, 0.3), "x"), "not probabilities"),
    "logits as q": (lambda r: Proposal(torch.tensor([[58]]), torch.randn(1, 1, 64), "x"), "not probabilities"),
    "a token q gives 0": (lambda r: Proposal(torch.tensor([[58]]), one_hot(53), "x"), "a token its draft_probs give probability 0"),
    "a host longer than the tokens": (lambda r: Proposal(torch.tensor([[0]]), None, "x", host=[[0, 5, 5]]), "host copy"),
    "an id past the vocabulary": (lambda r: Proposal(torch.tensor([[64]]), None, "x"), r"outside the target's vocabulary \[0, 64\)"),
    "a negative id": (lambda r: Proposal(torch.tensor([[-1]]), None, "x"), "outside the target's vocabulary"),
    "float ids": (lambda r: Proposal(torch.tensor([[5.0]]), None, "x"), "integer tensor"),
    "two rows for one": (lambda r: Proposal(torch.tensor([[5], [6]]), None, "x"), r"integer tensor \[rows=1, k\]"),
    "more than asked for": (lambda r: Proposal(torch.tensor([[5] * (r.max_tokens + 1)]), None, "x"), "more than the"),
    "nothing": (lambda r: None, "a NoneType, not an hf_specdec Proposal"),
    "a q of another width": (lambda r: Proposal(torch.tensor([[5]]), torch.ones(1, 1, 60) / 60, "x"), r"vocab=64\]"),
    # raw NotImplementedError / TypeError before
    "tokens on the meta device": (lambda r: Proposal(torch.zeros(1, 1, dtype=torch.long, device="meta"), None, "x"), "meta"),
    "q on the meta device": (lambda r: Proposal(torch.tensor([[5]]), torch.ones(1, 1, 64, device="meta") / 64, "x"), "meta"),
    "a host that is not a list per row": (lambda r: Proposal(torch.tensor([[5]]), None, "x", host=[5]), "a list of token ids per row"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_proposal_is_named(case):
    target = tiny_model("llama", vocab=64, seed=3)
    fn, message = BAD[case]
    with pytest.raises(ValueError, match=rf"the candidate_generator \(Fn\) proposed .*{message}"):
        target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=Fn(fn),
                        max_new_tokens=4, do_sample=True, adaptive=False)


def test_bad_answers_to_room_are_named():
    target = tiny_model("llama", vocab=64, seed=3)
    source = Fn(lambda r: Proposal(torch.tensor([[5]]), None, "x"), room=2.5)
    with pytest.raises(ValueError, match=r"\(Fn\).room\(\) must return an integer >= 0, got 2.5"):
        target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=source, max_new_tokens=4)


class NewTokensOnly(CandidateGenerator):
    """A transformers generator that forgot the prefix: candidate_ids are the new tokens alone."""

    def get_candidates(self, input_ids):
        return input_ids[:, -1:].repeat(1, 3), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


def test_max_rows_and_candidates_without_the_prefix_are_named():
    """Before: max_rows="2" was a TypeError; candidates without the input_ids were read as proposing
    nothing, every round, without a word."""
    target = tiny_model("llama", vocab=64, seed=3)
    source = Fn(lambda r: Proposal(torch.tensor([[5]]), None, "x"))
    source.max_rows = "2"
    with pytest.raises(ValueError, match=r"\(Fn\).max_rows must be a positive integer or None"):
        target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=source, max_new_tokens=4)
    with pytest.raises(ValueError, match="start with the input_ids it was given .length 8.*only the new tokens"):
        target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=NewTokensOnly(),
                        max_new_tokens=4, adaptive=False)


class Scribbler(Drafter):
    """A careless source that writes into the ids, prefixes and scores it is given."""

    def propose(self, request):
        last = request.ids[:, -1:].clone()
        request.ids[:, -1] = 60
        request.host[0].append(60)
        request.prefixes.sequences[0][-1] = 61
        return Proposal(last.repeat(1, min(2, request.max_tokens)), None, "scribbler")

    def update(self, ids, target_scores, num_accepted):
        target_scores.mul_(0)


class ScribblerGenerator(CandidateGenerator):
    def get_candidates(self, input_ids):
        input_ids[:, -1] = 3
        return torch.cat([input_ids, input_ids[:, -1:]], 1), None

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        input_ids[:, 0] = 4


@pytest.mark.parametrize("source", [Scribbler, ScribblerGenerator])
def test_a_source_writing_into_its_request_changes_nothing(source):
    """Before: the output differed from plain greedy and the caller's input_ids were rewritten (the loop's
    work sequence starts as the caller's tensor, and the source was handed it)."""
    target = tiny_model("llama", vocab=64, seed=3)
    ids = PROMPT.clone()
    kwargs = dict(max_new_tokens=16, do_sample=False, return_dict_in_generate=True, output_scores=True)
    out = target.generate(ids, custom_generate=hf_specdec.speculative_generate, candidate_generator=source(),
                          adaptive=False, num_draft_tokens=2, **kwargs)
    plain = target.generate(PROMPT, **kwargs)
    assert torch.equal(ids, PROMPT)
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out.scores, plain.scores))


class WholeSequenceLogits(CandidateGenerator):
    """A transformers generator that returns logits for the whole sequence, not the new candidates."""

    def get_candidates(self, input_ids):
        ids = torch.cat([input_ids, torch.tensor([[5, 6]])], dim=1)
        return ids, torch.randn(1, ids.shape[1], 64)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


def test_a_transformers_generator_with_the_whole_sequences_logits_is_named():
    """Before: the prompt positions' logits were taken as the candidates' q."""
    target = tiny_model("llama", vocab=64, seed=3)
    with pytest.raises(ValueError, match=r"candidate_logits of shape \(1, 10, 64\) for 2 new candidates"):
        target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=WholeSequenceLogits(),
                        max_new_tokens=4, do_sample=True)


class Echo(Drafter):
    """A well-behaved source of one's own: the row's last token twice, int32, as a point mass, with
    confidences but no host copy (which greedy tree rounds read: a TypeError before)."""

    def propose(self, request):
        last = request.ids[:, -1:].to(torch.int32)
        k = min(2, request.max_tokens)
        return Proposal(last.repeat(1, k), None, "echo", confidences=[[0.9] * k for _ in range(last.shape[0])])


def test_a_good_source_of_ones_own_stays_exact():
    """Greedy tree rounds read the host copy the check fills in (a source's law under sampling is the
    chi-square's business: tests/test_exactness.py runs sources of its own through the same check)."""
    target = tiny_model("llama", vocab=64, seed=3)
    out = target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=Echo(),
                          max_new_tokens=20, do_sample=False)
    assert out.tolist() == target.generate(PROMPT, max_new_tokens=20, do_sample=False).tolist()


class WideLogits(CandidateGenerator):
    """A transformers generator whose draft has 8 padding rows more than the target (logits 72 wide)."""

    def get_candidates(self, input_ids):
        return torch.cat([input_ids, input_ids[:, -1:].repeat(1, 2)], dim=1), torch.randn(1, 2, 72)

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        pass


def test_what_greedy_verification_does_not_read_is_not_checked():
    """Greedy reads no q: a generator's wider logits stay usable there (they are named when sampling)."""
    target = tiny_model("llama", vocab=64, seed=3)
    kwargs = dict(custom_generate=hf_specdec.speculative_generate, candidate_generator=WideLogits(), max_new_tokens=6)
    assert target.generate(PROMPT, do_sample=False, **kwargs).tolist() == \
        target.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist()
    with pytest.raises(ValueError, match=r"draft_probs \(1, 2, 72\): they must be q"):
        target.generate(PROMPT, do_sample=True, **kwargs)


def test_trees_runners_up_and_padding_from_a_source():
    """A tree from a source was verified greedily even when sampling (trees are the loop's own); runner-up
    ids past the vocabulary met the embedding; padding past a row's length (-1) is fed as 0, never kept."""
    from hf_specdec.proposals.base import Tree

    target = tiny_model("llama", vocab=64, seed=3)
    tree = Fn(lambda r: Proposal(torch.tensor([[5, 6]]), None, "x", tree=Tree([-1, -1], 0, [True, True])))
    runner = Fn(lambda r: Proposal(torch.tensor([[5]]), None, "x", host=[[5]], confidences=[[0.5]], runners_up=[[(99, 0.1)]]))
    padded = Fn(lambda r: Proposal(torch.tensor([[5, -1]])[:, : r.max_tokens], None, "x", host=[[5][: r.max_tokens]]))
    run = lambda source, **kw: target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate,  # noqa: E731
                                               candidate_generator=source, max_new_tokens=6, adaptive=False, **kw)
    with pytest.raises(ValueError, match="a tree: a source proposes chains"):
        run(tree, do_sample=True)
    with pytest.raises(ValueError, match=r"runners_up outside the vocabulary \[0, 64\)"):
        run(runner, do_sample=False)
    assert run(padded, do_sample=False).tolist() == target.generate(PROMPT, max_new_tokens=6, do_sample=False).tolist()


def test_the_librarys_own_sources_are_not_checked(monkeypatch):
    """No read a round is added to them: the check is never called."""
    target = tiny_model("llama", vocab=64, seed=3)
    monkeypatch.setattr(hf_specdec.proposals.checked.CheckedDrafter, "check", lambda *a: pytest.fail("checked"))
    for source in (hf_specdec.NgramDrafter(), hf_specdec.NgramCandidateGenerator(),
                   hf_specdec.DraftModelDrafter(tiny_model("llama", vocab=64, seed=4), None, False)):
        target.generate(PROMPT, custom_generate=hf_specdec.speculative_generate, candidate_generator=source, max_new_tokens=4)


def test_the_candidate_generators_say_how_many_tokens_they_draft():
    """transformers 5.25's assisted loop reads `num_drafting_tokens` (its own generators define it): ours
    raised AttributeError there."""
    from hf_specdec.proposals import DraftCandidateGenerator, NgramCandidateGenerator

    target = tiny_model("llama", vocab=64, seed=3)
    assert DraftCandidateGenerator(target, None, 5, do_sample=False).num_drafting_tokens == 5
    assert NgramCandidateGenerator(max_tokens=7).num_drafting_tokens == 7


def test_less_used_entry_points_name_their_inputs():
    """Before: DraftCandidateGenerator took num_draft_tokens of 0, -1 or True and kept an autograd graph in its
    logits when called by hand; NgramDrafter raised an IndexError on a request built without `host`;
    pack_linears raised an AttributeError for a bare nn.Linear and ignored decode_bits on a packed model."""
    from hf_specdec.cpu import packing_problem
    from hf_specdec.proposals import DraftCandidateGenerator, DraftRequest, NgramDrafter
    from hf_specdec.sampling import Prefixes

    target = tiny_model("llama", vocab=64, seed=3)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="num_draft_tokens must be a positive integer"):
            DraftCandidateGenerator(target, None, bad, do_sample=False)
    generator = DraftCandidateGenerator(target, None, 3, do_sample=True)
    _, logits = generator.get_candidates(PROMPT)
    assert logits is not None and not logits.requires_grad
    repeats = torch.tensor([[1, 5, 9, 2, 5, 9]])
    request = DraftRequest(repeats, None, Prefixes.from_tensor(repeats, [0]), 3)  # built without `host`
    assert NgramDrafter().propose(request).tokens.tolist() == [[2, 5, 9]]
    if packing_problem():
        pytest.skip(packing_problem())
    with pytest.raises(ValueError, match="wrap a bare nn.Linear"):
        hf_specdec.pack_linears(torch.nn.Linear(3, 4))
    packed = hf_specdec.pack_linears(tiny_model("llama", vocab=64, seed=3))
    with pytest.raises(ValueError, match="packed already"):
        hf_specdec.pack_linears(packed, decode_bits=8)

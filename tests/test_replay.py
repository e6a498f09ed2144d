"""The lookup replay (evals/lookup_replay.py): its model of transformers' prompt lookup proposes what
transformers proposes, and replaying a greedy output takes as many target forwards as the real run."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "evals"))

from costs import CostTable  # noqa: E402
from lookup_replay import Replay, accepted_walk, prompt_lookup, prompt_lookup_chain, retrieval  # noqa: E402


def flat_table() -> CostTable:
    """Every target forward 1 s whatever its width (so a replay's seconds count its forwards)."""
    return CostTable(widths=[1, 9, 33], contexts=[1, 4096], forwards={"target": [[1.0] * 3, [1.0] * 3]},
                     prefills=[1, 4096], prefill={"target": [1.0, 1.0]},
                     position={"greedy": {"transformers": 0.0, "hf_specdec": 0.0}})


def test_prompt_lookup_model_proposes_what_transformers_proposes():
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        length = int(torch.randint(2, 40, (1,), generator=gen))
        sequence = torch.randint(0, 6, (length,), generator=gen)  # a small alphabet: many matches
        ours = prompt_lookup_chain(sequence.tolist(), 2, 10)
        theirs = PromptLookupCandidateGenerator(num_output_tokens=10, max_matching_ngram_size=2, max_length=1000)
        candidates, _ = theirs.get_candidates(sequence[None])
        assert ours == candidates[0, length:].tolist(), (trial, sequence.tolist())


def test_accepted_walk_follows_the_known_output_down_the_tree():
    # root -> 5 -> 6 -> 7, root -> 5 -> 8, root -> 9
    tokens, parents = [5, 6, 7, 8, 9], [-1, 0, 1, 0, -1]
    assert accepted_walk(tokens, parents, [5, 8, 1]) == [0, 3]
    assert accepted_walk(tokens, parents, [5, 6, 7, 7]) == [0, 1, 2]
    assert accepted_walk(tokens, parents, [4]) == []


def test_replayed_prompt_lookup_takes_the_real_runs_forwards():
    """transformers' prompt lookup on a tiny model, greedy: its target forwards equal the rounds the
    replay counts from plain greedy's output alone (for a flat table, the replay's seconds)."""
    model = tiny_model("llama", seed=3)
    prompt = torch.tensor([[1, 7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 11, 12, 13, 7, 8]])
    plain = model.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1]:].tolist()
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        lookup = model.generate(prompt, max_new_tokens=24, do_sample=False, prompt_lookup_num_tokens=10)
    finally:
        handle.remove()
    assert lookup[0, prompt.shape[1]:].tolist() == plain
    seconds, log = Replay(flat_table(), "transformers").run(prompt[0].tolist(), plain, prompt_lookup())
    assert seconds == len(log) == len(calls) < len(plain)  # lookups were accepted, and counted alike
    # The library's retrieval trees, replayed: every round emits at least one token, all are emitted.
    seconds, log = Replay(flat_table(), "hf_specdec").run(prompt[0].tolist(), plain, retrieval(0.02, 0.02, min_ngram=1))
    assert sum(emitted for _, emitted in log) == len(plain) and len(log) < len(plain)


def _coupled_law(tokens, parents, p_at, vocab, depth):
    """The law of (accepted path, extra token) when the tree is walked along a text sampled plainly from
    the target (what `lookup_replay --mode sampling` does): enumerate every text of depth + 1 tokens."""
    import itertools

    law = {}
    for text in itertools.product(range(vocab), repeat=depth + 1):
        path = accepted_walk(tokens, parents, list(text))
        weight, node = 1.0, -1
        for i in range(len(path) + 1):  # the tokens the walk read: each drawn from p after the node reached
            weight *= float(p_at(node)[text[i]])
            node = path[i] if i < len(path) else node
        weight /= vocab ** (depth - len(path))  # the tokens the walk never read: summed out
        key = (tuple(path), text[len(path)])
        law[key] = law.get(key, 0.0) + weight
    return law


def _point_mass_rule_without_renormalising(tokens, parents, p_at, generator):
    """A broken verifier: a later sibling is accepted with r(y) instead of r(y) / sum(r)."""
    from hf_specdec.verify import draw

    node, path = -1, []
    while True:
        residual, accepted = p_at(node).clone(), None
        for child in [j for j, parent in enumerate(parents) if parent == node]:
            if float(torch.rand((), generator=generator)) < float(residual[tokens[child]]):
                accepted = child
                break
            residual[tokens[child]] = 0.0
        if accepted is None:
            return path, int(draw(residual[None], generator)[0])
        path.append(accepted)
        node = accepted


def test_sampling_replay_has_the_law_of_the_tree_rule():
    """The sampling replay's coupling (accept the child equal to a plainly sampled token) gives the
    rounds of retrieval trees (point masses only) the same law as the library's rule: 20000 draws of
    `tree_speculative_sampling` against the exactly enumerated law of the coupled walk, chi-square
    p > 0.001 (fixed seeds). A verifier that does not renormalise after a rejected sibling fails it."""
    from scipy.stats import chisquare

    from hf_specdec.verify import tree_speculative_sampling

    vocab = 4
    # root -> 0 -> 1 -> 2, root -> 1 (a sibling), node 0 -> 3 (a sibling), node 1 -> 0
    tokens, parents = [0, 1, 2, 1, 3, 0], [-1, 0, 1, -1, 0, 1]
    gen = torch.Generator().manual_seed(7)
    probs = {}
    for node in range(-1, len(tokens)):  # a flat Dirichlet draw per node: p after that node
        e = -torch.log(torch.rand(vocab, generator=gen))
        probs[node] = e / e.sum()
    p_at = probs.__getitem__
    law = _coupled_law(tokens, parents, p_at, vocab, depth=3)
    assert abs(sum(law.values()) - 1.0) < 1e-6
    keys = sorted(law)

    def statistic(verifier, seed):
        generator = torch.Generator().manual_seed(seed)
        counts = dict.fromkeys(keys, 0)
        for _ in range(20000):
            path, extra = verifier(tokens, parents, p_at, generator)
            counts[(tuple(path), extra)] += 1
        observed = [counts[k] for k in keys]
        expected = [law[k] * 20000 for k in keys]
        return chisquare(observed, [e * sum(observed) / sum(expected) for e in expected]).pvalue

    library = lambda t, par, p, g: tree_speculative_sampling(t, par, None, p, generator=g)  # noqa: E731
    assert statistic(library, 0) > 1e-3
    assert statistic(_point_mass_rule_without_renormalising, 0) < 1e-6

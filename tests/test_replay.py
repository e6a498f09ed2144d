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

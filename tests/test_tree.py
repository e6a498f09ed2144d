"""Trees of candidates: retrieval of every continuation, the trie, the cost model's node choice, one
target forward over a tree (4D mask), the kept branch's cache, and the exactness of the tree rule."""

from __future__ import annotations

import pytest
import torch

import hf_specdec
from conftest import perturbed, tiny_model
from hf_specdec.cache import extend_tree, keep_path, new_cache
from hf_specdec import Costs
from hf_specdec.planner import Planner
from hf_specdec.proposals.base import Proposal, Tree
from hf_specdec.proposals.tree import (
    Trie, ancestors_mask, depths, longest_matches, match_bucket, match_length, ngram_continuations, path_tokens,
    retrieval_reach, retrieve, tree_depth, tree_proposal,
)
from hf_specdec.stats import DRAFT, NGRAM, NONE
from hf_specdec.verify import greedy_tree_verification

ALPHA = 1e-3  # a correct rule fails a chi-square test here with probability 0.001


# ---------------------------------------------------------------- retrieval and the trie


def test_continuations_are_distinct_most_recent_first_for_the_longest_match():
    seq = torch.tensor([1, 5, 2, 7, 1, 5, 3, 8, 9, 1, 5, 2, 7, 4, 1, 5])
    # last 2-gram (1, 5) occurs at 0, 4, 9: continuations (2, 7, 1), (3, 8, 9), (2, 7, 4); most recent first
    assert ngram_continuations(seq, 3, 2, 3, 8) == [[2, 7, 4], [3, 8, 9], [2, 7, 1]]
    assert ngram_continuations(seq, 3, 2, 3, 2) == [[2, 7, 4], [3, 8, 9]]
    # a longer match wins: (4, 1, 5) never occurred before, (1, 5) did; with (7, 1, 5) ... none
    assert ngram_continuations(torch.tensor([1, 2, 3, 9, 1, 2, 3]), 3, 2, 2, 4) == [[9, 1]]
    assert ngram_continuations(torch.tensor([1, 2, 3, 4]), 3, 2, 5, 4) == []
    # the first continuation is prompt lookup's proposal
    assert ngram_continuations(seq, 3, 2, 3, 8)[0] == hf_specdec.proposals.ngram_lookup(seq, 3, 2, 3).tolist()


def test_matches_are_measured_past_the_ngram_and_the_longest_is_followed():
    """The last 2-gram (1, 5) occurs at 1, 7 and 12; measured further back, the occurrence at 7 matches
    5 tokens (8, 4, 3, 1, 5 as at the end), the others 2 and 3. With a cap above n only the longest
    match's size bucket is kept, longest first, then earliest; without one, every occurrence, most
    recent first."""
    seq = [0, 1, 5, 2, 8, 4, 3, 1, 5, 7, 9, 3, 1, 5, 6, 8, 4, 3, 1, 5]
    starts = [1, 7, 12]
    assert [match_length(seq, s, 2, 32) for s in starts] == [2, 5, 3]
    assert match_length(seq, 7, 2, 4) == 4  # the cap
    assert [match_bucket(m, 3) for m in (1, 2, 3, 4, 7, 8, 15, 16, 40)] == [1, 2, 3, 4, 4, 8, 8, 16, 32]
    assert [match_bucket(m, 5) for m in (5, 6, 7, 8)] == [5, 6, 6, 8]  # never below max_ngram + 1
    assert longest_matches(seq, starts, 2, 3, 32) == ([7], 4)
    assert longest_matches(seq, starts, 2, 3, 0) == ([12, 7, 1], 2)  # off: most recent first, size n
    # capped at 3: the match at 7 counts as 3, as the one at 12 does; the earliest first
    assert longest_matches(seq, starts, 2, 3, 3) == ([7, 12], 3)
    assert retrieve(seq, 2, 1, 3, 8, 32) == ([[7, 9, 3]], 4)
    assert retrieve(seq, 2, 1, 3, 8, 0) == ([[6, 8, 4], [7, 9, 3], [2, 8, 4]], 2)
    tokens, size = hf_specdec.proposals.ngram_match(seq, 2, 1, 3, 32)
    assert tokens == [7, 9, 3] and size == 4
    tokens, size = hf_specdec.proposals.ngram_match(seq, 2, 1, 3)
    assert tokens == [6, 8, 4] and size == 2


def test_a_long_matchs_acceptance_is_learned_apart_and_lengthens_the_lookup():
    """Lookups after 3-token matches accepted for one token then rejected, after matches of 8-15
    tokens accepted whole: the acceptance model learns about 0.5 and about 1 per position, and the
    planner verifies a few tokens after the first, the whole continuation after the second."""
    planner = Planner(16, costs=Costs(draft_step=0.2, verify=0.05))
    for _ in range(40):
        planner.acceptance.observe_lookup(3, True)
        planner.acceptance.observe_lookup(3, False)
        for _ in range(12):
            planner.acceptance.observe_lookup(8, True)
    a3, a8 = planner.acceptance.lookup_at(3), planner.acceptance.lookup_at(8)
    assert a8 > 0.95 and 0.4 < a3 < 0.6
    chain = lambda a: [[a ** i for i in range(1, 13)]]  # noqa: E731
    assert len(planner.best_nodes(chain(a3))[0][0]) <= 4 and len(planner.best_nodes(chain(a8))[0][0]) == 12


def test_trie_merges_shared_prefixes_and_counts_continuations():
    trie = Trie()
    chain = trie.insert([2, 7], DRAFT, count=False)
    for continuation in ([2, 7, 4], [3, 8], [2, 6]):
        trie.insert(continuation, NGRAM, count=True)
    assert chain == [0, 1]
    assert trie.tokens == [2, 7, 4, 3, 8, 6] and trie.parents == [-1, 0, 1, -1, 3, 0]
    assert trie.counts == [2, 1, 1, 1, 1, 1] and trie.root_count == 3
    assert trie.children[-1] == [0, 3] and trie.children[0] == [1, 5]  # the draft's child first
    assert depths(trie.parents) == [0, 1, 2, 0, 1, 1] and tree_depth(trie.parents) == 3 and tree_depth([]) == 0
    assert path_tokens(trie.tokens, trie.parents, 2) == [2, 7, 4] and path_tokens(trie.tokens, trie.parents, -1) == []
    seen = ancestors_mask(trie.parents)
    assert seen[2].tolist() == [True, True, True, False, False, False]
    assert seen[4].tolist() == [False, False, False, True, True, False]
    # estimates: draft nodes by their own acceptance, retrieved ones by g * share, behind a draft sibling
    reach = retrieval_reach(trie, acceptance=0.5, draft_acceptance={0: 0.8, 1: 0.5})
    assert reach[0] == pytest.approx(0.8) and reach[1] == pytest.approx(0.4)
    assert reach[3] == pytest.approx(0.5 * 1 / 3 * (1 - 0.8))  # sibling of the draft's first token
    assert reach[4] == pytest.approx(reach[3] * 0.5)
    assert reach[5] == pytest.approx(0.8 * 0.5 * 1 / 2 * (1 - 0.5))  # continuation under the draft node 0
    assert reach[2] == pytest.approx(0.4 * 0.5 * 1.0)
    # nothing kept after the draft ran: a plain step, recorded and counted as one (it had been called "ngram")
    drafted = Proposal(torch.tensor([[2, 7]]), None, source=DRAFT, host=[[2, 7]], forwards=2)
    empty = tree_proposal(trie, [], drafted, NGRAM, torch.device("cpu"))
    assert empty.num_tokens == 0 and empty.source == NONE and empty.sources == [NONE] and empty.forwards == 2
    assert tree_proposal(trie, [3, 4], drafted, NGRAM, torch.device("cpu")).sources == [NGRAM]


def test_the_planner_keeps_tree_nodes_while_they_pay():
    planner = Planner(8, costs=Costs(draft_step=0.2, verify=0.05))
    reach = [0.9, 0.8, 0.3, 0.01, 0.2]
    assert planner.best_nodes([reach])[0] == [[0, 1, 2, 4]]  # 0.01 is not worth a verify slot
    assert planner.best_nodes([reach], most=2)[0] == [[0, 1]]
    assert planner.best_nodes([reach], keep=[[3]])[0] == [[0, 1, 2, 3, 4]]  # kept nodes come first
    dear = Planner(8, costs=Costs(draft_step=0.2, verify=1.0))
    assert dear.best_nodes([reach])[0] == [[]]  # a node costing a whole step never pays here
    assert planner.best_nodes([reach], most=2)[1] == pytest.approx((1 + 0.9 + 0.8) / (1 + 2 * 0.05))


def test_tree_shape_helpers():
    tree = Tree(parents=[-1, 0, 1, -1, 3, 0], chain=2, retrieved=[True, False, False, True, True, True])
    assert tree.chain_accepted([0, 1]) == 2 and tree.chain_accepted([0, 5]) == 1 and tree.chain_accepted([3, 4]) == 0
    # root: retrieved children 0, 3 -> went on through 0 (retrieved); node 0: children 1 (not), 5 (retrieved) -> 1
    assert tree.retrieval_events([0, 1]) == [True, False]
    assert tree.retrieval_events([]) == [False]
    # the draft's first forward proposed node 0 (its token) and the runner-up node 3 beside it (not retrieved)
    tree = Tree(parents=[-1, 0, -1, -1], chain=2, retrieved=[False, False, True, False])
    assert tree.from_draft(0) and tree.from_draft(1) and tree.from_draft(3) and not tree.from_draft(2)
    assert not Tree([-1, -1], 0, [True, True]).from_draft(0)
    with pytest.raises(ValueError, match="parents must come before"):
        ancestors_mask([1, -1])


def test_greedy_tree_follows_the_target_argmax():
    tokens, parents = [2, 7, 3, 8, 9], [-1, 0, -1, 2, 3]
    best = {-1: 3, 2: 8, 3: 9, 4: 1}
    assert greedy_tree_verification(tokens, parents, lambda n: best[n]) == ([2, 3, 4], 1)
    assert greedy_tree_verification(tokens, parents, lambda n: 5) == ([], 5)


# ---------------------------------------------------------------- one forward over a tree


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@torch.no_grad()
def test_tree_forward_gives_each_branch_its_own_logits_and_keeps_the_accepted_branch(arch):
    model = tiny_model(arch, vocab=64, seed=3)
    prompt = torch.tensor([[1, 9, 4, 17, 9, 4]])
    tokens, parents = [5, 6, 7, 8, 11, 12], [-1, 0, 0, -1, 3, 1]
    cache = new_cache(model)
    model(input_ids=prompt[:, :-1], cache=cache, use_cache=True)  # the cache lacks the last token
    logits = extend_tree(model, cache, prompt, torch.tensor([tokens]), ancestors_mask(parents), depths(parents))[0]
    for node in range(-1, len(tokens)):
        branch = torch.tensor([path_tokens(tokens, parents, node)], dtype=torch.long)
        full = model(torch.cat([prompt, branch], dim=1)).logits[0, -1]
        torch.testing.assert_close(logits[node + 1], full, atol=1e-4, rtol=1e-4)
    path = [0, 1, 5]  # 5, 6, 12
    keep_path(cache, prompt.shape[1], path, len(tokens))
    assert cache.get_seq_length() == prompt.shape[1] + 3
    following = torch.tensor([[13]])
    continued = model(input_ids=following, cache=cache, use_cache=True).logits[0, -1]
    reference = model(torch.cat([prompt, torch.tensor([[5, 6, 12]]), following], dim=1)).logits[0, -1]
    torch.testing.assert_close(continued, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", [[0, 1, 5], [0, 1], [3, 4], [2], []])
@torch.no_grad()
def test_keep_path_keeps_the_sequence_and_the_path_in_place(path):
    """keep_path leaves the sequence's columns where they are (no copy of the whole cache each round)
    and ends the cache with the path's columns, in path order."""
    model = tiny_model("llama", vocab=64, seed=3)
    prompt = torch.tensor([[1, 9, 4, 17, 9, 4]])
    tokens, parents = [5, 6, 7, 8, 11, 12], [-1, 0, 0, -1, 3, 1]
    cache = new_cache(model)
    model(input_ids=prompt[:, :-1], cache=cache, use_cache=True)
    extend_tree(model, cache, prompt, torch.tensor([tokens]), ancestors_mask(parents), depths(parents))
    length = prompt.shape[1]
    before = [(layer.keys.clone(), layer.values.clone(), layer.keys.data_ptr()) for layer in cache.layers]
    keep_path(cache, length, path, len(tokens))
    order = list(range(length)) + [length + node for node in path]
    assert cache.get_seq_length() == length + len(path)
    for layer, (keys, values, pointer) in zip(cache.layers, before):
        torch.testing.assert_close(layer.keys, keys[:, :, order], rtol=0, atol=0)
        torch.testing.assert_close(layer.values, values[:, :, order], rtol=0, atol=0)
        assert layer.keys.data_ptr() == pointer  # the same storage: only the tree's columns were written
    with pytest.raises(RuntimeError, match="cached columns"):
        keep_path(cache, length, path, len(tokens))  # the tree's columns are gone: a second call is a bug


# ---------------------------------------------------------------- generate with trees

REPETITIVE = torch.tensor([[1, 5, 2, 9, 1, 5, 3, 8, 1, 5, 4, 6, 7, 1, 5]])  # (1, 5) seen thrice: three branches


def _tree_records(target, draft, prompt, new_tokens=40, **kwargs):
    records = []
    out = target.generate(
        prompt, max_new_tokens=new_tokens, custom_generate=hf_specdec.speculative_generate, assistant=draft,
        acceptance_sink=records.append, costs=Costs(draft_step=0.05, verify=0.02), return_dict_in_generate=True, **kwargs,
    )
    return out, records


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_with_trees_equals_plain_greedy(arch):
    target = tiny_model(arch, vocab=16, seed=4)
    draft = perturbed(target, noise=0.2)
    plain = target.generate(REPETITIVE, max_new_tokens=40, do_sample=False)
    out, records = _tree_records(target, draft, REPETITIVE, do_sample=False)
    assert torch.equal(out.sequences, plain)
    branching = [r for r in records if r.parents is not None and len(set(r.parents)) < len(r.parents)]
    assert branching, "no round verified a branching tree"
    assert any(r.path and r.parents is not None for r in records)
    assert {r.accepted_from for r in records if r.parents is not None} >= {"draft", "ngram"}  # both sources accepted
    for r in records:
        if r.parents is not None:
            assert r.num_accepted == len(r.path) and r.emitted_tokens[: r.num_accepted] == [r.draft_tokens[j] for j in r.path]
            # the cost model's estimate per node: a probability, never above its parent's
            est = r.estimated_acceptance
            assert est is not None and len(est) == len(r.draft_tokens) and all(0 <= e <= 1 for e in est)
            assert all(est[j] <= est[p] + 1e-12 for j, p in enumerate(r.parents) if p >= 0)
    chain, _ = _tree_records(target, draft, REPETITIVE, do_sample=False, tree=False)
    assert torch.equal(chain.sequences, plain)


def test_trees_switch_off_for_batches_and_tree_false():
    target = tiny_model("llama", vocab=16, seed=4)
    draft = perturbed(target, noise=0.2)
    _, records = _tree_records(target, draft, REPETITIVE, do_sample=False, tree=False)
    assert all(r.parents is None for r in records)
    batch = REPETITIVE.repeat(2, 1)
    _, records = _tree_records(target, draft, batch, do_sample=False, attention_mask=torch.ones_like(batch))
    assert all(r.parents is None for r in records)
    with pytest.raises(ValueError, match="tree_max_nodes"):
        hf_specdec.SpeculativeConfig(tree_max_nodes=0)


def test_trees_by_default_for_greedy_decoding_chains_when_sampling():
    """tree=True (the default): trees in greedy calls; sampling calls verify chains (sampled trees
    did not pay on held-out prompts under two cost tables: evals/results/sampled-trees/held-out/)."""
    target = tiny_model("llama", vocab=16, seed=4)
    draft = perturbed(target, noise=0.2)
    assert hf_specdec.SpeculativeConfig().tree is True
    with pytest.raises(ValueError, match="tree must be"):
        hf_specdec.SpeculativeConfig(tree="yes")
    _, records = _tree_records(target, draft, REPETITIVE, do_sample=False)
    assert any(r.parents is not None for r in records)
    torch.manual_seed(0)
    _, records = _tree_records(target, draft, REPETITIVE, do_sample=True, temperature=0.7)
    assert records and all(r.parents is None for r in records)
    # with a RetrievalCache whose matches have several continuations (where sampled trees, deleted
    # after a held-out check, used to branch): chains still, some of them the cache's
    cache, records = hf_specdec.RetrievalCache(), []
    for seed in range(6):
        torch.manual_seed(seed)
        records += _tree_records(target, draft, REPETITIVE, do_sample=True, temperature=1.5, retrieval_cache=cache)[1]
    assert any(r.retrieval == "cache" for r in records) and all(r.parents is None for r in records)


def test_trees_stop_exactly_at_eos_and_max_new_tokens():
    target = tiny_model("qwen2", vocab=16, seed=4)
    draft = perturbed(target, noise=0.2)
    free = target.generate(REPETITIVE, max_new_tokens=40, do_sample=False)[0, REPETITIVE.shape[1] :].tolist()
    ended_in_a_tree = 0
    for eos in dict.fromkeys(free[5:]):  # tokens first generated at different depths
        target.generation_config.eos_token_id = eos
        plain = target.generate(REPETITIVE, max_new_tokens=40, do_sample=False, eos_token_id=eos)
        out, records = _tree_records(target, draft, REPETITIVE, do_sample=False, eos_token_id=eos)
        assert torch.equal(out.sequences, plain), f"eos={eos}"
        ended_in_a_tree += records[-1].parents is not None and records[-1].num_accepted > 0
    target.generation_config.eos_token_id = None
    assert ended_in_a_tree, "no run stopped inside an accepted tree branch"
    for max_new_tokens in range(1, 14):
        plain = target.generate(REPETITIVE, max_new_tokens=max_new_tokens, do_sample=False)
        out, records = _tree_records(target, draft, REPETITIVE, do_sample=False, new_tokens=max_new_tokens)
        assert torch.equal(out.sequences, plain), f"max_new_tokens={max_new_tokens}"


def test_one_target_forward_per_tree_round():
    target = tiny_model("llama", vocab=16, seed=4)
    draft = perturbed(target, noise=0.2)
    calls = []
    handle = target.register_forward_hook(lambda module, args, output: calls.append(1))
    try:
        _, records = _tree_records(target, draft, REPETITIVE, do_sample=False)
    finally:
        handle.remove()
    assert any(r.parents is not None for r in records)
    assert len(calls) == len(records)  # one row: one record and one target forward per round


def test_a_tree_round_counts_its_depth_as_drafted():
    """acceptance_rate over a tree round is accepted / the most it could accept (its depth), not over
    every node: runners-up and retrieved siblings at one depth can never all be accepted (the CLI had
    printed 0/50 after three draft forwards)."""
    target = tiny_model("llama", vocab=16, seed=4)
    out, records = _tree_records(target, perturbed(target, noise=0.2), REPETITIVE, do_sample=False)
    trees = [r for r in records if r.parents is not None]
    assert any(len(r.parents) > 1 + max(depths(r.parents)) for r in trees)  # some tree branched
    depth = lambda r: len(r.draft_tokens) if r.parents is None else tree_depth(r.parents)  # noqa: E731
    stats = out.acceptance
    assert stats.drafted == sum(depth(r) for r in records) == sum(stats.drafted_per_position)
    assert stats.accepted == sum(r.num_accepted for r in records) and 0 < stats.acceptance_rate <= 1
    assert len(stats.drafted_per_position) == max(depth(r) for r in records)

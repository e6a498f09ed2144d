"""At most three device-to-host reads per round (the README's bound), counted on tiny models.

A read is any call that hands a tensor's value to Python: Tensor.item, tolist, bool(), int(),
float(), cpu(), numpy(). On an accelerator each is a synchronisation; on the CPU it is free, and
there hf_specdec spends a few more to sample cheaper (`hf_specdec.verify.reads_are_free`). These
tests switch those CPU paths off, so they count what an accelerator would run. Counted: reads made
by any code but transformers' (hf_specdec's, a user's processors and criteria) between the start of a round's proposal and the end of its retirement.
transformers' own forward makes a read of its own when a batch's forward has one query column and
a padding mask (`masking_utils`: whether the mask can be dropped), as plain batched generate does
every step; those are reported by `reads_per_round` but not bounded here.
"""

from __future__ import annotations

import sys

import pytest
import torch
import transformers

import hf_specdec
import hf_specdec.generate as generate_module
import hf_specdec.rounds
import hf_specdec.sampling
import hf_specdec.verify
from conftest import perturbed, tiny_model

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")
BOUND = 3
TRANSFORMERS = transformers.__path__[0]


def reads_per_round(monkeypatch, call) -> tuple[list[int], list[int]]:
    """(hf_specdec's reads in each round, everyone's reads in each round) during `call()`."""
    monkeypatch.setattr(hf_specdec.verify, "reads_are_free", lambda device: False)
    monkeypatch.setattr(hf_specdec.sampling, "reads_are_free", lambda device: False)
    monkeypatch.setattr(hf_specdec.rounds, "reads_are_free", lambda device: False)
    monkeypatch.setattr(hf_specdec.proposals.draft_model, "reads_are_free", lambda device: False)
    ours, everyone, start = [0], [0], [0, 0]
    own_rounds, all_rounds = [], []

    def counting(original):
        def wrapper(self, *args, **kwargs):
            everyone[0] += 1
            if not sys._getframe(1).f_code.co_filename.startswith(TRANSFORMERS):
                ours[0] += 1
            return original(self, *args, **kwargs)
        return wrapper

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name)))
    propose, retire = generate_module.propose, generate_module.retire

    def counted_propose(state):
        start[:] = [ours[0], everyone[0]]
        return propose(state)

    def counted_retire(state, finished):
        retire(state, finished)
        own_rounds.append(ours[0] - start[0])
        all_rounds.append(everyone[0] - start[1])

    monkeypatch.setattr(generate_module, "propose", counted_propose)
    monkeypatch.setattr(generate_module, "retire", counted_retire)
    call()
    monkeypatch.undo()
    return own_rounds, all_rounds


CASES = {
    "greedy tree": (1, dict(do_sample=False)),
    "greedy chain": (1, dict(do_sample=False, tree=False)),
    "sampling chain": (1, dict(do_sample=True, temperature=0.8, top_p=0.9)),
    "greedy batch": (4, dict(do_sample=False)),
    "sampling batch": (4, dict(do_sample=True, top_k=20)),
    "measured costs": (1, dict(do_sample=True, top_k=20, costs=None)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_at_most_three_reads_per_round(monkeypatch, case):
    rows, kwargs = CASES[case]
    target = tiny_model("llama", vocab=64, seed=1)
    draft = perturbed(target, noise=0.02)  # close to the target: most rounds draft, some look up
    ids = torch.randint(1, 64, (rows, 12), generator=torch.Generator().manual_seed(0))
    kwargs = {"costs": hf_specdec.Costs(draft_step=0.1, verify=0.01), **kwargs}
    out = []
    own, everyone = reads_per_round(monkeypatch, lambda: out.append(target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, custom_generate=hf_specdec.speculative_generate,
        assistant=draft, return_dict_in_generate=True, **kwargs)))
    stats = out[0].acceptance
    assert len(own) == stats.rounds > 5
    if case != "measured costs":  # (measured, a draft as large as the target never pays: the clock path is counted)
        assert stats.draft_forwards > 0  # the draft model ran: its read is among those counted
    assert max(own) <= BOUND, f"{case}: reads per round {own}"
    if rows == 1:  # a single row's forwards read nothing of their own
        assert everyone == own


def test_the_counter_sees_a_read_per_drafted_token(monkeypatch):
    """The counter is not blind: a draft that reads its confidence after every token (as the loop did
    before one copy per round) exceeds the bound."""
    from hf_specdec.proposals import draft_model

    original = draft_model.DraftModelDrafter._next

    def reading_next(self, prefixes, drafts, logits, report):
        token, q, parts = original(self, prefixes, drafts, logits, report)
        [part.tolist() for part in parts]  # the old per-token read
        return token, q, parts

    monkeypatch.setattr(draft_model.DraftModelDrafter, "_next", reading_next)
    target = tiny_model("llama", vocab=64, seed=1)
    draft = perturbed(target, noise=0.02)
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    own, _ = reads_per_round(monkeypatch, lambda: target.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, custom_generate=hf_specdec.speculative_generate,
        assistant=draft, tree=False, costs=hf_specdec.Costs(draft_step=0.1, verify=0.01)))
    assert max(own) > BOUND


LOOP_MODULES = ("batch.py", "cache.py", "continuous.py", "rounds.py", "sampling.py", "verify.py", "proposals")


def test_the_loop_uploads_host_values_only_through_to_device():
    """A host list made into a device tensor (`torch.tensor(values, device=...)`, or a CPU tensor
    `.to(device)`) is a blocking copy that waits for the device's queue: on the H200, CUDA counted one
    synchronisation per call (evals/results/gpu-h200/). The loop uploads through `hf_specdec.host.to_device`
    (pinned memory, an asynchronous copy). A CPU cannot see the difference, so this reads the source."""
    import re
    from pathlib import Path

    root = Path(hf_specdec.__file__).parent
    files = [p for name in LOOP_MODULES for p in ([root / name] if name.endswith(".py") else sorted((root / name).glob("*.py")))]
    offending = []
    for path in files:
        text = path.read_text()
        for call in re.finditer(r"torch\.(?:tensor|as_tensor)\((?:[^()]|\([^()]*\))*\)", text):
            if "device=" in call.group(0) and 'device="cpu"' not in call.group(0):  # a host tensor is no upload
                line = text.count("\n", 0, call.start()) + 1
                offending.append(f"{path.relative_to(root)}:{line}: {call.group(0)[:80]}")
    allowed = {"continuous.py"}  # a stream's prompts, once per request (torch.as_tensor of the user's item)
    offending = [o for o in offending if o.split(":")[0] not in allowed]
    assert not offending, "upload through hf_specdec.host.to_device:\n" + "\n".join(offending)


def test_to_device_keeps_values_and_dtype():
    from hf_specdec.host import to_device

    assert to_device([[1, 2], [3, 4]], "cpu").tolist() == [[1, 2], [3, 4]]
    assert to_device([1, 2], "cpu").dtype == torch.long
    assert to_device(True, "cpu", torch.bool).item() is True
    mask = torch.tensor([[True, False]])
    assert torch.equal(to_device(mask, "cpu", torch.bool), mask)

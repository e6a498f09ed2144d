"""The acceptance rule of speculative decoding, as pure torch (no transformers import).

Vocabulary (as in vLLM's rejection sampler):
  * accepted token:  a draft token the rule keeps;
  * recovered token: the token sampled at the first rejection, from the residual distribution;
  * bonus token:     the token sampled from the target when every draft token was accepted.
Every round emits the accepted tokens plus exactly one recovered or bonus token.

Math (Leviathan et al. 2023, arXiv:2211.17192, Algorithm 1; Chen et al. 2023, arXiv:2302.01318,
Algorithm 2). Write p for the *target* distribution and q for the *draft* distribution the draft
token x was sampled from, both after the full logits-processor pipeline:
  * accept x with probability min(1, p(x) / q(x));
  * at the first rejection, sample from normalize(max(0, p - q));
  * if all k draft tokens are accepted, sample one bonus token from p at position k + 1.
The emitted tokens are then distributed exactly as if sampled from p one by one.

A proposal with no distribution behind it (n-gram lookup, a greedy draft) is a point mass:
q = one-hot(x). Passing `draft_probs=None` means exactly that, without building the one-hot
tensors: x is accepted with probability p(x), and the residual is p with x removed.

Two forms of the rule, which consume the same random numbers and return the same tokens:
  * `speculative_sampling`: p given at every position up front (eager);
  * `lazy_speculative_sampling`: p asked for chunk by chunk, only as far as some row still needs it.

Departure from the paper: when max(0, p - q) sums to (numerically) zero, which happens when p equals
q up to rounding, the residual is undefined; we sample from p instead of producing NaN. The event
"reject although p == q" has probability equal to the residual mass, so this changes nothing
measurable (see `RESIDUAL_EPS`).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch

# Residual mass below which max(0, p - q) is treated as zero and we fall back to sampling from p.
# Float32 probabilities carry ~1e-7 relative error per entry, so a true residual below ~1e-6 cannot
# be told apart from rounding noise; the rejection it guards has at most that probability.
RESIDUAL_EPS = 1e-6

# Filler for positions after the emitted tokens of a row in `emitted_tokens`.
PAD_TOKEN = -1

# `draw` samples among the non-zero entries only when at most this fraction of the vocabulary is non-zero.
SPARSE_FRACTION = 1 / 8

def reads_are_free(device: torch.device) -> bool:
    """Whether reading a value back to the host costs nothing much (the CPU: no copy, no
    synchronisation). There a few reads buy cheaper sampling (sparse top-p and draws, p computed only
    as far as needed); on an accelerator each would stall the queue, and those paths are skipped."""
    return device.type == "cpu"


# p at target positions [start, stop): [batch, stop - start, vocab].
TargetProbsAt = Callable[[int, int], torch.Tensor]


def speculative_sampling(
    draft_tokens: torch.Tensor,  # [batch, k] int64: the draft tokens, x_1..x_k
    draft_probs: torch.Tensor | None,  # [batch, k, vocab]: q, the distribution each x_i was drawn from; None: point masses
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]: p at every drafted position, plus one
    generator: torch.Generator | None = None,
    lengths: torch.Tensor | None = None,  # [batch] int64: row b proposed its first lengths[b] tokens only; None: all k
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastic verification (Leviathan et al. 2023, Algorithm 1), batched over rows.

    Per-row lengths: row b's drafts past lengths[b] are padding, never accepted, and when its
    lengths[b] drafts are all accepted its extra token is the bonus, from p at position lengths[b]
    (q is not subtracted there: nothing was proposed). A row of length 0 is a plain step.

    Returns:
        num_accepted:   [batch] int64, in 0..k.
        emitted_tokens: [batch, k + 1] int64; row b holds num_accepted[b] accepted tokens followed
                        by one recovered or bonus token, then PAD_TOKEN.
    """
    _check_tensors(draft_tokens=draft_tokens, draft_probs=draft_probs, target_probs=target_probs)
    _check_shapes(draft_tokens, target_probs, draft_probs)
    draft_tokens = draft_tokens.long()  # any integer dtype (uint8 ids compared with a vocabulary past 255 overflow)
    _check_lengths(draft_tokens, lengths, values=True)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    _check_values(draft_tokens, target_probs, draft_probs, lengths)
    uniforms = _uniforms(draft_tokens, generator)  # [batch, k]
    accepted = _accepts(draft_tokens, draft_probs, target_probs, uniforms) & _proposed(draft_tokens, lengths)  # [batch, k]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]: length of accepted prefix
    extra_token = _extra_token(draft_tokens, draft_probs, target_probs, num_accepted, generator, lengths)
    return num_accepted, _assemble(draft_tokens, num_accepted, extra_token)


def lazy_speculative_sampling(
    draft_tokens: torch.Tensor,  # [batch, k] int64
    draft_probs: torch.Tensor | None,  # [batch, k, vocab]: q; None: point masses
    target_probs_at: TargetProbsAt,  # (start, stop) -> p at positions [start, stop): [batch, stop - start, vocab]
    generator: torch.Generator | None = None,
    first_chunk: int = 4,  # config.LAZY_FIRST_CHUNK (this module imports nothing of the package)
    lengths: torch.Tensor | None = None,  # [batch]: per-row proposal lengths, as in `speculative_sampling`
    check: bool = True,  # the inputs checked by value, as `speculative_sampling` checks them (the loop: False)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`speculative_sampling` with p computed only as far as it matters.

    p at a position after a row's first rejection never influences that row, and computing it can
    cost a full-vocabulary pass through the processors (top-p sorts the vocabulary), for every one
    of up to 32 n-gram proposals. So p is requested in chunks of positions ([0, 4), then 8 more,
    then 16, ...) until every row has either rejected a draft or reached its bonus position.

    Exact, and the same function of the random stream as the eager rule: all k uniforms are drawn
    first, in the same call as `speculative_sampling` draws them, and draft i is tested against
    uniform i whenever it is reached, so the accepted prefix does not depend on where the chunks
    end; the one extra token is then drawn from the same distribution (residual or bonus), by the
    same multinomial call, once the position where it is drawn is known.

    Returns num_accepted [batch], emitted_tokens [batch, k + 1] (as `speculative_sampling`) and p
    at the positions computed, [batch, n, vocab] with num_accepted + 1 <= n <= k + 1 for every row.
    """
    if check:
        target_probs_at = _checked(draft_tokens, draft_probs, target_probs_at, generator, lengths, first_chunk)
    batch, k = draft_tokens.shape
    draft_tokens = draft_tokens.long()
    _check_lengths(draft_tokens, lengths, values=check)
    if not reads_are_free(draft_tokens.device):  # an accelerator: p everywhere at once, no read to decide
        first_chunk = k + 1
    uniforms = _uniforms(draft_tokens, generator)  # [batch, k]
    proposed = _proposed(draft_tokens, lengths)  # [batch, k]
    num_accepted = torch.full((batch,), k, dtype=torch.long, device=draft_tokens.device)
    decided = torch.zeros(batch, dtype=torch.bool, device=draft_tokens.device)
    chunks, start, size = [], 0, operator.index(first_chunk)
    while True:
        stop = min(k + 1, start + size)
        chunks.append(target_probs_at(start, stop))  # [batch, stop - start, vocab]
        if start == 0:
            _check_shapes(draft_tokens[:, : stop - 1], chunks[0], None if draft_probs is None else draft_probs[:, : stop - 1])
        tested = min(stop, k)  # draft positions start..tested-1 are tested against this chunk
        q = None if draft_probs is None else draft_probs[:, start:tested]
        accepted = _accepts(draft_tokens[:, start:tested], q, chunks[-1], uniforms[:, start:tested])  # [batch, tested - start]
        accepted &= proposed[:, start:tested]
        first_rejection = start + accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]
        newly = ~decided & (first_rejection < tested)
        num_accepted = torch.where(newly, first_rejection, num_accepted)
        decided |= newly
        if stop == k + 1 or bool(decided.all()):
            break
        start, size = stop, 2 * size
    target_probs = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=1)  # [batch, stop, vocab]
    extra_token = _extra_token(draft_tokens, draft_probs, target_probs, num_accepted, generator, lengths)
    return num_accepted, _assemble(draft_tokens, num_accepted, extra_token), target_probs


def greedy_verification(
    draft_tokens: torch.Tensor,  # [batch, k] int64
    target_scores: torch.Tensor,  # [batch, k + 1, vocab]: processed target scores (argmax is taken)
    lengths: torch.Tensor | None = None,  # [batch]: per-row proposal lengths, as in `speculative_sampling`
    check: bool = True,  # ids in the vocabulary and lengths in 0..k, read back to check (the loop: False)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept while the draft token is the target's argmax, then emit the
    target's argmax at the first disagreement (or at position k + 1 when all agree).

    Returns (num_accepted [batch], emitted_tokens [batch, k + 1]) exactly like `speculative_sampling`.
    """
    if check:
        _check_tensors(draft_tokens=draft_tokens, target_scores=target_scores)
    _check_shapes(draft_tokens, target_scores)
    _check_lengths(draft_tokens, lengths, values=check)
    draft_tokens = draft_tokens.long()  # any integer dtype (uint8 ids compared with a vocabulary past 255 overflow)
    if check and bool((((draft_tokens < 0) | (draft_tokens >= target_scores.shape[-1])) & _proposed(draft_tokens, lengths)).any()):
        raise ValueError(f"draft_tokens hold ids outside the vocabulary [0, {target_scores.shape[-1]})")
    target_argmax = target_scores.argmax(dim=-1)  # [batch, k + 1]
    agree = (draft_tokens == target_argmax[:, :-1]) & _proposed(draft_tokens, lengths)  # [batch, k]
    num_accepted = agree.long().cumprod(dim=-1).sum(dim=-1)  # [batch]
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    return num_accepted, _assemble(draft_tokens, num_accepted, target_argmax[rows, num_accepted])


def _proposed(draft_tokens: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:  # [batch, k] bool
    """Which draft positions each row really proposed (all of them without `lengths`)."""
    if lengths is None:
        return torch.ones_like(draft_tokens, dtype=torch.bool)
    positions = torch.arange(draft_tokens.shape[1], device=draft_tokens.device)
    return positions[None, :] < lengths[:, None]


def _uniforms(draft_tokens: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:  # [batch, k]
    return torch.rand(draft_tokens.shape, generator=generator, device=draft_tokens.device)


def _accepts(
    draft_tokens: torch.Tensor,  # [batch, j]
    draft_probs: torch.Tensor | None,  # [batch, j, vocab] or None (point masses: q(x) = 1)
    target_probs: torch.Tensor,  # [batch, >= j, vocab]
    uniforms: torch.Tensor,  # [batch, j]
) -> torch.Tensor:  # [batch, j] bool
    """Accept x_i with probability min(1, p(x_i) / q(x_i)): u * q < p with u ~ U[0, 1). Written
    without division so that p(x) == 0 never accepts, whatever q(x) is."""
    # [batch, j, 1]; padding past a row's length may hold anything (PAD_TOKEN): any id in range will do there
    index = draft_tokens.long().clamp(0, target_probs.shape[-1] - 1).unsqueeze(-1)
    p_x = target_probs[:, : draft_tokens.shape[1]].float().gather(-1, index).squeeze(-1)  # [batch, j]
    if draft_probs is None:
        return uniforms < p_x
    q_x = draft_probs.float().gather(-1, index).squeeze(-1)  # [batch, j]
    return uniforms * q_x < p_x


def _extra_token(
    draft_tokens: torch.Tensor,  # [batch, k]
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] or None (point masses)
    target_probs: torch.Tensor,  # [batch, > max(num_accepted), vocab]
    num_accepted: torch.Tensor,  # [batch]
    generator: torch.Generator | None,
    lengths: torch.Tensor | None = None,  # [batch]: per-row proposal lengths (None: k)
) -> torch.Tensor:  # [batch]
    """The one extra token: from the residual normalize(max(0, p - q)) at the first rejected position,
    or from p itself at the row's last proposed position + 1 (bonus), where q is taken as zero so the
    residual *is* p."""
    batch, k = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_n = target_probs[rows, num_accepted].float()  # [batch, vocab]
    rejected = num_accepted < (k if lengths is None else lengths)  # [batch]: False at the bonus position
    if draft_probs is None:
        # q = one-hot(x): max(0, p - q) is p with x's entry zeroed.
        x_n = torch.nn.functional.pad(draft_tokens.long(), (0, 1))[rows, num_accepted]  # [batch]
        residual = p_n.scatter(-1, x_n.clamp(0, p_n.shape[-1] - 1)[:, None], 0.0)  # at a padded position: the bonus
        residual = torch.where(rejected[:, None], residual, p_n)
    else:
        q_n = torch.nn.functional.pad(draft_probs.float(), (0, 0, 0, 1))[rows, num_accepted]  # [batch, vocab]
        residual = torch.where(rejected[:, None], (p_n - q_n).clamp_min(0.0), p_n)
    mass = residual.sum(dim=-1, keepdim=True)  # [batch, 1]
    # Guard (departure from the paper, see module docstring): zero residual -> sample from p.
    extra_dist = torch.where(mass > RESIDUAL_EPS, residual / mass.clamp_min(RESIDUAL_EPS), p_n)
    return draw(extra_dist, generator)


def draw(
    probs: torch.Tensor,  # [batch, vocab]: non-negative weights (each row need not sum to 1)
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [batch] int64
    """One token per row, with probability proportional to its weight.

    After top-k / top-p / min-p only a few hundred of ~150k entries are non-zero, and on a CPU a
    multinomial draw over the whole vocabulary costs more than the rest of a round's sampling. So on
    the CPU, when every row has at most SPARSE_FRACTION of the vocabulary non-zero, the draw is made
    among the non-zero entries only (picked by `topk`): the same law (weights proportional to the
    same numbers), other random numbers consumed. Elsewhere: `torch.multinomial` over the row.
    """
    vocab = probs.shape[-1]
    if reads_are_free(probs.device) and vocab >= 1024:
        support = int((probs > 0).sum(dim=-1).max())
        if 0 < support <= vocab * SPARSE_FRACTION:
            weights, index = probs.topk(support, dim=-1)  # [batch, support]: every non-zero entry (and zeros)
            return index.gather(-1, torch.multinomial(weights, 1, generator=generator)).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _assemble(
    draft_tokens: torch.Tensor,  # [batch, k]
    num_accepted: torch.Tensor,  # [batch]
    extra_token: torch.Tensor,  # [batch]: the recovered or bonus token
) -> torch.Tensor:  # [batch, k + 1]
    """Accepted prefix, then the extra token at index num_accepted, then PAD_TOKEN."""
    batch, k = draft_tokens.shape
    positions = torch.arange(k + 1, device=draft_tokens.device).expand(batch, k + 1)  # [batch, k + 1]
    padded = torch.nn.functional.pad(draft_tokens, (0, 1), value=PAD_TOKEN)  # [batch, k + 1]
    n = num_accepted.unsqueeze(-1)  # [batch, 1]
    emitted = torch.where(positions < n, padded, torch.full_like(padded, PAD_TOKEN))
    return torch.where(positions == n, extra_token.unsqueeze(-1), emitted)


def _checked(draft_tokens: torch.Tensor, draft: torch.Tensor | None, target_probs_at: TargetProbsAt,
             generator: torch.Generator | None, lengths: torch.Tensor | None, first_chunk: int) -> TargetProbsAt:
    """The public lazy rule's arguments, and `target_probs_at` whose every chunk is checked as
    `speculative_sampling` checks p (with the ids and q once, at the first chunk)."""
    _check_tensors(draft_tokens=draft_tokens, draft_probs=draft)
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, k] integer ids, got {tuple(draft_tokens.shape)}")
    if not callable(target_probs_at):
        raise ValueError(f"target_probs_at must be a callable (start, stop) -> p, got {type(target_probs_at).__name__}")
    try:
        chunk = None if isinstance(first_chunk, bool) else operator.index(first_chunk)  # a numpy or 0-d tensor int too
    except TypeError:
        chunk = None
    if chunk is None or chunk < 1:
        raise ValueError(f"first_chunk must be a positive int (positions of p asked for first), got {first_chunk!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    draft_tokens = draft_tokens.long()

    def at(start: int, stop: int) -> torch.Tensor:
        chunk = target_probs_at(start, stop)
        shape = (draft_tokens.shape[0], stop - start)
        if not isinstance(chunk, torch.Tensor) or chunk.dim() != 3 or tuple(chunk.shape[:2]) != shape:
            raise ValueError(f"target_probs_at({start}, {stop}) must return [batch, {stop - start}, vocab], got "
                             f"{tuple(getattr(chunk, 'shape', ())) or type(chunk).__name__}")
        # padded to the rule's whole width: positions outside the chunk are not checked (`used` is False there)
        full = torch.nn.functional.pad(chunk, (0, 0, start, draft_tokens.shape[1] + 1 - stop), value=1.0 / chunk.shape[-1])
        if start == 0:
            _check_shapes(draft_tokens, full, draft)
        _check_values(draft_tokens, full, draft if start == 0 else None, lengths, ids=start == 0)
        return chunk

    return at


def _check_tensors(**named: torch.Tensor | None) -> None:
    """The public rules take tensors (None only where q may be None): a list or an array is named, not an
    AttributeError."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor) and not (value is None and name == "draft_probs"):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__} (torch.as_tensor converts one)")


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None = None) -> None:
    if draft_tokens.dim() != 2 or draft_tokens.is_floating_point() or draft_tokens.is_complex() or draft_tokens.dtype == torch.bool:
        raise ValueError(f"draft_tokens must be [batch, k] integer ids, got shape {tuple(draft_tokens.shape)} "
                         f"of {draft_tokens.dtype}")
    batch, k = draft_tokens.shape
    if target.dim() != 3 or target.shape[:2] != (batch, k + 1):
        raise ValueError(f"target distribution must be [batch={batch}, k+1={k + 1}, vocab], got {tuple(target.shape)}")
    if draft is not None and (draft.dim() != 3 or draft.shape[:2] != (batch, k) or draft.shape[-1] != target.shape[-1]):
        raise ValueError(
            f"draft distribution must be [batch={batch}, k={k}, vocab={target.shape[-1]}], got {tuple(draft.shape)}"
        )


def _check_lengths(draft_tokens: torch.Tensor, lengths: torch.Tensor | None, values: bool = False) -> None:
    """`lengths` as the rules take it: an integer tensor [batch]; with `values` (the public eager rule, which
    may read the device) each in 0..k: a length past k would make the bonus position a padding one."""
    if lengths is None:
        return
    batch, k = draft_tokens.shape
    if not isinstance(lengths, torch.Tensor) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool \
            or tuple(lengths.shape) != (batch,):
        raise ValueError(f"lengths must be an integer tensor of shape [batch={batch}], got "
                         f"{tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths).__name__}"
                         + (f" of {lengths.dtype}" if isinstance(lengths, torch.Tensor) else ""))
    if values and batch and bool(((lengths < 0) | (lengths > k)).any()):
        shown = lengths.tolist() if batch <= 8 else f"values from {lengths.min().item()} to {lengths.max().item()}"
        raise ValueError(f"lengths must be in 0..k={k} (the drafts each row proposed), got {shown}")


def _check_values(draft_tokens: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
                  lengths: torch.Tensor | None, ids: bool = True) -> None:
    """The eager rule's inputs by value where they are used (it is public; the decode loop calls the lazy
    rule, which reads nothing to check): proposed ids inside the vocabulary, and probabilities, not logits,
    at the proposed positions and the bonus position after them (padding past them may hold anything)."""
    vocab, proposed = target.shape[-1], _proposed(draft_tokens, lengths)  # [batch, k]
    if ids and bool((((draft_tokens < 0) | (draft_tokens >= vocab)) & proposed).any()):
        raise ValueError(f"draft_tokens hold ids outside the vocabulary [0, {vocab})")
    used = torch.nn.functional.pad(proposed, (1, 0), value=True)  # [batch, k + 1]: p up to the bonus position
    if bool(probability_flaws(target, used)[0]):
        raise ValueError("target_probs must be probabilities (non-negative, summing to 1 over the vocabulary; softmax of logits)")
    if draft is not None:
        not_probs, unlikely = torch.stack(probability_flaws(draft, proposed, draft_tokens)).tolist()
        if not_probs:
            raise ValueError("draft_probs must be probabilities (non-negative, summing to 1 over the vocabulary; softmax "
                             "of logits)")
        if unlikely:  # a token q cannot have drawn: its ratio p/q is not the rule's
            raise ValueError("draft_tokens hold a token its draft_probs give probability 0: each token must be drawn "
                             "from the q given for its position")


def probability_flaws(probs: torch.Tensor, where: torch.Tensor,
                      tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device, without a read: whether a row of `probs` [batch, n, vocab] at `where` [batch, n] is not
    a distribution (not finite, negative, or not summing to 1 within 1e-2), and with `tokens` [batch, n]
    whether one there gives its token probability 0 (a token it could not have drawn)."""
    values = probs.float()
    not_probs = ~torch.isfinite(values).all(-1) | (values < 0).any(-1) | ((values.sum(-1) - 1).abs() > 1e-2)
    if tokens is None:
        return (not_probs & where).any(), torch.zeros((), dtype=torch.bool, device=probs.device)
    unlikely = values.gather(-1, tokens.clamp(0, probs.shape[-1] - 1)[..., None])[..., 0] <= 0
    return (not_probs & where).any(), (unlikely & where).any()


# ---------------------------------------------------------------- trees of candidates
#
# A tree proposal (`hf_specdec.proposals.tree`) is flat: node j has a token and a parent (-1: the
# row's last real token, the root); parents come before children. Trees are verified greedily (the
# loop verifies sampled rounds as chains): follow the target's argmax down the tree; emit it where
# no child holds it. The output is plain greedy's, token for token.


def greedy_tree_verification(
    tokens: list[int],  # [n]
    parents: list[int],  # [n]
    target_argmax_at: Callable[[int], int],  # node -> the target's argmax after it
) -> tuple[list[int], int]:
    """Follow the target's argmax down the tree. Returns (accepted nodes, the extra token)."""
    tokens, parents = (x.tolist() if isinstance(x, torch.Tensor) else list(x) for x in (tokens, parents))
    if len(tokens) != len(parents):  # (tensors as dict keys would hash by identity: no child ever found)
        raise ValueError(f"a tree has one token per node: {len(tokens)} tokens for {len(parents)} parents")
    children = _tree_children(parents)
    node, path = -1, []
    while True:
        best = target_argmax_at(node)
        accepted = next((c for c in children.get(node, ()) if tokens[c] == best), None)
        if accepted is None:
            return path, best
        path.append(accepted)
        node = accepted


def _tree_children(parents: list[int]) -> dict[int, list[int]]:
    """node -> its children in order; checks the tree's shape."""
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"tree node {j} has parent {parent}: parents must come before their children")
        children.setdefault(parent, []).append(j)
    return children

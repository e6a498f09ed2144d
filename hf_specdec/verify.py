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

Departure from the paper: when max(0, p - q) sums to (numerically) zero, which happens when p equals
q up to rounding, the residual is undefined; we sample from p instead of producing NaN. The event
"reject although p == q" has probability equal to the residual mass, so this changes nothing
measurable (see `RESIDUAL_EPS`).
"""

from __future__ import annotations

import torch

# Residual mass below which max(0, p - q) is treated as zero and we fall back to sampling from p.
# Float32 probabilities carry ~1e-7 relative error per entry, so a true residual below ~1e-6 cannot
# be told apart from rounding noise; the rejection it guards has at most that probability.
RESIDUAL_EPS = 1e-6

# Filler for positions after the emitted tokens of a row in `emitted_tokens`.
PAD_TOKEN = -1


def speculative_sampling(
    draft_tokens: torch.Tensor,  # [batch, k] int64: the draft tokens, x_1..x_k
    draft_probs: torch.Tensor,  # [batch, k, vocab]: q, the distribution each x_i was drawn from
    target_probs: torch.Tensor,  # [batch, k + 1, vocab]: p at every drafted position, plus one
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastic verification (Leviathan et al. 2023, Algorithm 1), batched over rows.

    Returns:
        num_accepted:   [batch] int64, in 0..k.
        emitted_tokens: [batch, k + 1] int64; row b holds num_accepted[b] accepted tokens followed
                        by one recovered or bonus token, then PAD_TOKEN.
    """
    batch, k = draft_tokens.shape
    _check_shapes(draft_tokens, target_probs, draft_probs)
    target_probs = target_probs.float()
    draft_probs = draft_probs.float()

    # 1. Accept x_i with probability min(1, p(x_i) / q(x_i)): u * q < p with u ~ U[0, 1).
    #    Written without division so that p(x) == 0 never accepts, whatever q(x) is.
    index = draft_tokens.unsqueeze(-1)  # [batch, k, 1]
    p_x = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [batch, k]
    q_x = draft_probs.gather(-1, index).squeeze(-1)  # [batch, k]
    u = torch.rand(p_x.shape, generator=generator, device=p_x.device)  # [batch, k]
    accepted = u * q_x < p_x  # [batch, k]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]: length of accepted prefix

    # 2. The distribution of the one extra token: the residual normalize(max(0, p - q)) at the first
    #    rejected position, or p itself at position k (bonus): q is zero-padded there, so the
    #    residual *is* p.
    rows = torch.arange(batch, device=draft_tokens.device)
    p_n = target_probs[rows, num_accepted]  # [batch, vocab]
    q_padded = torch.nn.functional.pad(draft_probs, (0, 0, 0, 1))  # [batch, k + 1, vocab]
    residual = (p_n - q_padded[rows, num_accepted]).clamp_min(0.0)  # [batch, vocab]
    mass = residual.sum(dim=-1, keepdim=True)  # [batch, 1]
    # Guard (departure from the paper, see module docstring): zero residual -> sample from p.
    extra_dist = torch.where(mass > RESIDUAL_EPS, residual / mass.clamp_min(RESIDUAL_EPS), p_n)
    extra_token = torch.multinomial(extra_dist, 1, generator=generator).squeeze(-1)  # [batch]

    return num_accepted, _assemble(draft_tokens, num_accepted, extra_token)


def greedy_verification(
    draft_tokens: torch.Tensor,  # [batch, k] int64
    target_scores: torch.Tensor,  # [batch, k + 1, vocab]: processed target scores (argmax is taken)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept while the draft token is the target's argmax, then emit the
    target's argmax at the first disagreement (or at position k + 1 when all agree).

    Returns (num_accepted [batch], emitted_tokens [batch, k + 1]) exactly like `speculative_sampling`.
    """
    _check_shapes(draft_tokens, target_scores)
    target_argmax = target_scores.argmax(dim=-1)  # [batch, k + 1]
    agree = draft_tokens == target_argmax[:, :-1]  # [batch, k]
    num_accepted = agree.long().cumprod(dim=-1).sum(dim=-1)  # [batch]
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    return num_accepted, _assemble(draft_tokens, num_accepted, target_argmax[rows, num_accepted])


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


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None = None) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, k], got shape {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if target.dim() != 3 or target.shape[:2] != (batch, k + 1):
        raise ValueError(f"target distribution must be [batch={batch}, k+1={k + 1}, vocab], got {tuple(target.shape)}")
    if draft is not None and (draft.dim() != 3 or draft.shape[:2] != (batch, k) or draft.shape[-1] != target.shape[-1]):
        raise ValueError(
            f"draft distribution must be [batch={batch}, k={k}, vocab={target.shape[-1]}], got {tuple(draft.shape)}"
        )

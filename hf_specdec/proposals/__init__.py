"""Where draft tokens come from: one `Proposal` type that every source returns, one `Drafter` protocol.

Sources: the draft model (`DraftModelDrafter`), n-gram lookup in the prompt and output
(`NgramDrafter`), and any transformers `CandidateGenerator` (`CandidateGeneratorDrafter`, the one
wrapper a foreign generator gets, at the entry point). The decode loop talks to every source
through `Drafter.propose` and `Drafter.update` and reads what it needs from the `Proposal`.
"""

from .base import Drafter, DraftRequest, Proposal
from .draft_model import DraftCandidateGenerator, DraftModelDrafter
from .foreign import CandidateGeneratorDrafter
from .ngram import NgramCandidateGenerator, NgramDrafter, ngram_lookup, ngram_match

__all__ = [
    "CandidateGeneratorDrafter",
    "DraftCandidateGenerator",
    "DraftModelDrafter",
    "DraftRequest",
    "Drafter",
    "NgramCandidateGenerator",
    "NgramDrafter",
    "Proposal",
    "ngram_lookup",
    "ngram_match",
]

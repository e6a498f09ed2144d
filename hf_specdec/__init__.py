"""hf_specdec: exact speculative decoding for Hugging Face transformers.

    import hf_specdec
    out = target.generate(**inputs, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, num_draft_tokens=5, do_sample=True,
                          return_dict_in_generate=True)
    out.acceptance.acceptance_rate
"""

from pathlib import Path

import transformers as _transformers

# Every forward passes the cache as `cache=` and reads outputs' `.cache`: transformers 5.23 and later.
# An older one ignores the keyword and every call would fail deep inside; say so here instead.
_found = tuple(int(part) for part in _transformers.__version__.split(".")[:2] if part.isdigit())
if _found < (5, 23):
    raise ImportError(
        f"hf_specdec needs transformers >= 5.23 (it passes the KV cache as `cache=`); found {_transformers.__version__}. "
        "pip install 'transformers>=5.23,<6' (evals/gpu_run.sh installs a carried wheel where nothing can be fetched)."
    )

from .cache import UnsupportedCacheError
from .config import Costs, SpeculativeConfig
from .cpu import PackedLinear, pack_linears
from .continuous import StreamError, StreamResult, generate_continuous
from .generate import SpeculativeDecoderOnlyOutput, StreamerNotForwardedError, speculative_generate
from .planner import CostEstimates, Planner
from .proposals import (
    CandidateGeneratorDrafter,
    DraftCandidateGenerator,
    Drafter,
    DraftModelDrafter,
    DraftRequest,
    NgramCandidateGenerator,
    NgramDrafter,
    Proposal,
)
from .quantize import quantize_weights
from .retrieval import RetrievalCache
from .self_draft import early_exit_draft
from .stats import AcceptanceStats, RoundRecord
from .verify import greedy_tree_verification, greedy_verification, lazy_speculative_sampling, speculative_sampling

# Folder holding `custom_generate/generate.py`: pass it as `custom_generate=` (with
# `trust_remote_code=True`) to use the standard `assistant_model=` and `streamer=` arguments.
CUSTOM_GENERATE_DIR = str(Path(__file__).parent / "recipe")

__version__ = "0.1.0"

__all__ = [
    "CUSTOM_GENERATE_DIR",
    "AcceptanceStats",
    "CandidateGeneratorDrafter",
    "CostEstimates",
    "Costs",
    "DraftCandidateGenerator",
    "DraftModelDrafter",
    "DraftRequest",
    "Drafter",
    "NgramCandidateGenerator",
    "NgramDrafter",
    "PackedLinear",
    "Planner",
    "Proposal",
    "RetrievalCache",
    "RoundRecord",
    "SpeculativeConfig",
    "SpeculativeDecoderOnlyOutput",
    "StreamError",
    "StreamResult",
    "StreamerNotForwardedError",
    "UnsupportedCacheError",
    "early_exit_draft",
    "greedy_tree_verification",
    "generate_continuous",
    "greedy_verification",
    "lazy_speculative_sampling",
    "pack_linears",
    "quantize_weights",
    "speculative_generate",
    "speculative_sampling",
]

"""hf_specdec: exact speculative decoding for Hugging Face transformers.

    import hf_specdec
    out = target.generate(**inputs, custom_generate=hf_specdec.speculative_generate,
                          assistant=draft, num_draft_tokens=5, do_sample=True,
                          return_dict_in_generate=True)
    out.acceptance.acceptance_rate
"""

from pathlib import Path

from .candidates import DraftCandidateGenerator
from .config import SpeculativeConfig
from .generate import SpeculativeDecoderOnlyOutput, speculative_generate
from .ngram import NgramCandidateGenerator
from .policy import DraftPolicy
from .quantize import quantize_weights
from .stats import AcceptanceStats, RoundRecord
from .verify import greedy_verification, speculative_sampling

# Folder holding `custom_generate/generate.py`: pass it as `custom_generate=` (with
# `trust_remote_code=True`) to use the standard `assistant_model=` and `streamer=` arguments.
CUSTOM_GENERATE_DIR = str(Path(__file__).parent / "recipe")

__version__ = "0.1.0"

__all__ = [
    "CUSTOM_GENERATE_DIR",
    "AcceptanceStats",
    "DraftCandidateGenerator",
    "DraftPolicy",
    "NgramCandidateGenerator",
    "RoundRecord",
    "SpeculativeConfig",
    "SpeculativeDecoderOnlyOutput",
    "greedy_verification",
    "quantize_weights",
    "speculative_generate",
    "speculative_sampling",
]

"""An `evaluate` metric over logged speculative-decoding rounds.

    metric = evaluate.load("evals/metrics/speculative_acceptance")
    metric.compute(drafted=[5, 5, 3], accepted=[5, 2, 0], emitted=[6, 3, 1],
                   seconds=1.9, baseline_seconds=3.1)

One input row per round (as hf_specdec's `RoundRecord`s log them): tokens drafted, accepted and
emitted. Returns the acceptance rate (accepted / drafted), mean tokens emitted per round (per target
forward), and, when timings are given, the speedup baseline_seconds / seconds.
"""

import datasets
import evaluate

_DESCRIPTION = __doc__
_CITATION = """\
@inproceedings{leviathan2023fast,
  title={Fast Inference from Transformers via Speculative Decoding},
  author={Leviathan, Yaniv and Kalman, Matan and Matias, Yossi},
  booktitle={ICML}, year={2023}, note={arXiv:2211.17192}
}
"""
_INPUTS = """
Args:
    drafted (list of int): draft tokens proposed in each round.
    accepted (list of int): draft tokens accepted in each round (<= drafted).
    emitted (list of int): tokens appended to the output in each round (accepted + 1, or fewer at a stop).
    seconds (float, optional): wall time of the speculative runs these rounds come from.
    baseline_seconds (float, optional): wall time of plain decoding of the same prompts.
Returns:
    acceptance_rate, mean_tokens_per_round, rounds, and speedup when both timings are given.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _INPUTS)
class SpeculativeAcceptance(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_INPUTS,
            features=datasets.Features(
                {
                    "drafted": datasets.Value("int64"),
                    "accepted": datasets.Value("int64"),
                    "emitted": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, drafted, accepted, emitted, seconds=None, baseline_seconds=None):
        if any(a > d for a, d in zip(accepted, drafted)):
            raise ValueError("a round accepted more tokens than it drafted")
        total_drafted = sum(drafted)
        result = {
            "rounds": len(drafted),
            "acceptance_rate": sum(accepted) / total_drafted if total_drafted else 0.0,
            "mean_tokens_per_round": sum(emitted) / len(emitted) if emitted else 0.0,
        }
        if seconds is not None and baseline_seconds is not None:
            result["speedup"] = baseline_seconds / seconds
        return result

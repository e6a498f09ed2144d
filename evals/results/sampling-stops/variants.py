"""The standard preset's sampling replay (evals/replay.py) with one planner variant patched in, for
measurement only (nothing here is in the library):

    VAR=flat python evals/results/sampling-stops/variants.py --threads 1 \
        --cost-table evals/results/standard/cost_table.json --modes sampling --seed-offset 0 --ids 81 97 ... --out DIR

VAR (several joined by "+"):
  flat     the confidence calibration's prior (sampling) flat at PRIOR_DRAFT, not "acceptance = confidence"
  max      that prior at max(bin centre, PRIOR_DRAFT)
  meas     that prior at the acceptance measured per bin on these paths (calibration.py)
  lk05     PRIOR_LOOKUP 0.5, not 0.8
  pool0    the pooled deeper-depth draft acceptance also learns from first-depth tokens
  renewal  the stop rule drafts another token while its expected tokens beat the planned round's rate
           times its extra cost (a renewal-reward threshold), not while the round's own rate rises
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..")); sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
from hf_specdec import planner as P  # noqa: E402

VARS = set(os.environ.get("VAR", "").split("+")) - {""}
MEASURED = [.30, .46, .48, .54, .62, .62, .59, .71, .83, .95]  # calibration.py, sampling, 4 categories, seed 0

if "lk05" in VARS:
    P.PRIOR_LOOKUP = 0.5
prior = next((v for v in ("flat", "max", "meas") if v in VARS), None)
if prior:
    init = P.Planner.__init__

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.curve.lazy:  # sampling one row on a CPU (where the stop rule reads confidences)
            for b in range(P.BINS):
                centre = (b + 0.5) / P.BINS
                value = {"flat": P.PRIOR_DRAFT, "max": max(centre, P.PRIOR_DRAFT), "meas": MEASURED[b]}[prior]
                self.acceptance.hits[b] = P.BIN_PRIOR * value
    P.Planner.__init__ = patched_init
if "pool0" in VARS:
    def observe_draft(self, drafted, accepted, first_hit, confidences, weight):
        for i in range(min(accepted + 1, drafted)):
            hit = float(first_hit if i == 0 else i < accepted)
            self.pooled = P._ema(self.pooled, hit, weight / 2)  # every depth, the first included
            self.draft[i] = P._ema(self.draft_at(i), hit, weight)
            self.draft_seen[i] += 1
            if confidences is not None:
                b = min(max(int(confidences[i] * P.BINS), 0), P.BINS - 1)
                self.hits[b] += float(i < accepted)
                self.tries[b] += 1
    P.Acceptance.observe_draft = observe_draft
if "renewal" in VARS:
    def stop_rule(self, most):
        c, price, alpha = self.curve.draft_step, self.curve.verify_price, self.acceptance.draft_at
        rate = self.draft_length(most)[1]  # the rate a drafted round is planned to reach, before drafting
        reach, chain, state = [], [], [0.0, 0]

        def keep_drafting(confidences):
            calibrated = [self.acceptance.calibrated(x) for x in confidences]
            reach[:] = [r * q for r, q in zip(reach, calibrated)] if reach else calibrated
            state[0], state[1] = (state[0] or len(reach)) + sum(reach), state[1] + 1
            j = state[1]
            chain.append(reach[0])
            spent, tail, gain, ahead = j * c + price(j + 1, chain), sum(reach), 0.0, chain[:]
            for later in range(j + 1, most + 1):
                tail *= alpha(later - 1)
                gain += tail
                ahead.append(tail)
                if gain > rate * (later * c + price(later + 1, ahead) - spent):
                    return True
            return False
        return keep_drafting
    P.Planner.stop_rule = stop_rule

import replay  # noqa: E402

replay.main(sys.argv[1:])

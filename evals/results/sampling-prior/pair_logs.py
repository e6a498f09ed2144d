"""Paired by seed from evals/repetition.py's printed lines (one per call): the geometric mean over
samples of (tokens / modelled seconds) new over old, and how many samples the new run was faster on.
Usage: python pair_logs.py OLD.log NEW.log"""
import math
import re
import sys

LINE = re.compile(r"(\S+) hf_specdec\+cache (\S+) sample (\d+): (\d+) tokens, \d+ rounds.*?, ([\d.]+) s modelled")


def load(path):
    return {(m[2], int(m[3])): int(m[4]) / float(m[5]) for m in map(LINE.match, open(path)) if m}


old, new = load(sys.argv[1]), load(sys.argv[2])
ratios = [new[k] / old[k] for k in old if k in new]
print(f"{len(ratios)} samples paired: new / old rate {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}, "
      f"new faster on {sum(r > 1 for r in ratios)}")

"""Paired modelled comparison of two `evals/repetition.py` runs, sample by sample (same prompt, same seed):
    python paired.py OLD NEW [TABLE]     (each a run's folder or its records.jsonl, optionally :METHOD)
TABLE: the label of a table the runs were priced with (default "standard"), or a cost_table.json to
reprice both runs with (`evals/repetition.py`'s `price`: a workload's own position row where it has one)."""
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def load(path):
    """A run's records by (prompt, sample); PATH:METHOD keeps that method's only (a run of two methods)."""
    path, _, method = str(path).partition(":")
    path = Path(path)
    path = path / "records.jsonl" if path.is_dir() else path
    return {(r["id"], r["sample"]): r for r in map(json.loads, path.open()) if not method or r.get("method") == method}


def pricer(table):
    """record -> (hf_specdec's modelled seconds, plain's): as recorded under `table`, or repriced with a table file."""
    if not table.endswith(".json"):
        return lambda r: (r["modelled"][table]["hf_specdec"], r["modelled"][table]["plain"])
    sys.path[:0] = [str(ROOT / "evals"), str(ROOT)]
    from costs import load_table
    from repetition import price

    loaded = load_table(Path(table))
    return lambda r: price(r, loaded)


old, new = load(sys.argv[1]), load(sys.argv[2]); seconds = pricer(sys.argv[3] if len(sys.argv) > 3 else "standard")
keys = sorted(set(old) & set(new))
def sp(r):
    ours, plain = seconds(r); return plain / ours
def overall(rs):
    return sum(seconds(r)[1] for r in rs) / sum(seconds(r)[0] for r in rs)
ratios = [sp(new[k]) / sp(old[k]) for k in keys]
logs = [math.log(r) for r in ratios]
g = math.exp(sum(logs) / len(logs))
se = (sum((x - math.log(g)) ** 2 for x in logs) / max(1, len(logs) - 1) / len(logs)) ** 0.5
print(f"n={len(keys)} old overall {overall([old[k] for k in keys]):.3f}x new overall {overall([new[k] for k in keys]):.3f}x "
      f"paired geo-mean new/old {g:.3f} (95% {g * math.exp(-1.96 * se):.3f}-{g * math.exp(1.96 * se):.3f}), new faster on {sum(r > 1 for r in ratios)}; forwards old {sum(old[k]['target_forwards'] for k in keys)} new {sum(new[k]['target_forwards'] for k in keys)}")

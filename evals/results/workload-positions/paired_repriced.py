"""Paired modelled comparison of two `evals/repetition.py` runs (same prompt, same seed), both priced
with this folder's cost table (the workloads' own position rows), whatever table they were run under:

    python evals/results/workload-positions/paired_repriced.py OLD[:METHOD] NEW[:METHOD]

(each a run's folder or its records.jsonl). Prints both runs' pooled and geometric-mean speedups over
plain sampling and the paired geometric mean of NEW's speedup over OLD's, with a 95% interval."""
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "evals"))
sys.path.insert(0, str(HERE.parents[2]))

from costs import load_table  # noqa: E402
from repetition import price  # noqa: E402

TABLE = load_table(HERE / "cost_table.json")


def load(arg: str) -> dict:
    path, _, method = arg.partition(":")
    path = Path(path)
    path = path / "records.jsonl" if path.is_dir() else path
    return {(r["id"], r["sample"]): r for r in map(json.loads, path.open()) if not method or r.get("method") == method}


def speedup(record: dict) -> tuple[float, float, float]:
    ours, plain = price(record, TABLE)
    return plain / ours, ours, plain


def main() -> None:
    old, new = load(sys.argv[1]), load(sys.argv[2])
    keys = sorted(set(old) & set(new))
    logs = [math.log(speedup(new[k])[0] / speedup(old[k])[0]) for k in keys]
    mean = sum(logs) / len(logs)
    half = 1.96 * (sum((x - mean) ** 2 for x in logs) / max(1, len(logs) - 1) / len(logs)) ** 0.5
    pooled = lambda rs: sum(speedup(r)[2] for r in rs) / sum(speedup(r)[1] for r in rs)  # noqa: E731
    geo = lambda rs: math.exp(sum(math.log(speedup(r)[0]) for r in rs) / len(rs))  # noqa: E731
    o, n = [old[k] for k in keys], [new[k] for k in keys]
    print(f"n={len(keys)} old {pooled(o):.3f}x pooled ({geo(o):.3f} geometric), new {pooled(n):.3f}x ({geo(n):.3f}); "
          f"paired new/old {math.exp(mean):.3f} [{math.exp(mean - half):.3f}, {math.exp(mean + half):.3f}]; "
          f"target forwards old {sum(r['target_forwards'] for r in o)} new {sum(r['target_forwards'] for r in n)}")


if __name__ == "__main__":
    main()

"""Price the records of several eval runs with one cost table, so that their modelled figures can
be compared (each run otherwise prices its work with the table it measured itself).

    python evals/reprice.py evals/results/standard/records.jsonl evals/results/standard-packed/records.jsonl \
        --cost-table evals/results/standard/cost_table.json

Prints, per mode and method, the geometric mean over categories of the median modelled speedup (as
`run_eval.py` computes it) for each records file, and the difference to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REQUIRED, add_options, geometric_mean, speedup_over_plain  # noqa: E402
from costs import CostTable  # noqa: E402
from run_eval import _engine  # noqa: E402


def modelled_geomeans(records: list[dict], table: CostTable) -> dict[tuple[str, str], float]:
    """{(mode, method): geometric mean over categories of the median modelled speedup}."""
    seconds = {}
    for r in records:
        if r.get("work") and r.get("new_tokens"):
            seconds[id(r)] = table.modelled_seconds(r["work"], r["mode"], _engine(r["method"]))
    plain = {(r["mode"], r["id"]): r for r in records if r["method"] == "plain" and id(r) in seconds}
    speedups: dict[tuple[str, str], dict[str, list[float]]] = {}
    for r in records:
        base = plain.get((r["mode"], r["id"]))
        if r["method"] == "plain" or id(r) not in seconds or base is None:
            continue
        value = speedup_over_plain(r["new_tokens"], seconds[id(r)], base["new_tokens"], seconds[id(base)])
        speedups.setdefault((r["mode"], r["method"]), {}).setdefault(r["category"], []).append(value)
    return {key: geometric_mean(statistics.median(v) for v in cats.values()) for key, cats in speedups.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", help="records.jsonl files of eval runs")
    add_options(parser, cost_table=REQUIRED)  # the one table every run is priced with
    args = parser.parse_args(argv)
    table = CostTable.load(Path(args.cost_table))
    runs = [modelled_geomeans([json.loads(line) for line in open(path)], table) for path in args.records]
    for key in sorted(runs[0]):
        first = runs[0][key]
        cells = [f"{run[key]:.3f} ({100 * (run[key] / first - 1):+.1f}%)" if key in run else "-" for run in runs]
        print(f"{key[0]:9s} {key[1]:16s} " + "  ".join(cells))
    return {"|".join(k): [run.get(k) for run in runs] for k in runs[0]}


if __name__ == "__main__":
    main()

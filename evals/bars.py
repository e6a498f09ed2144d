"""The comparison table of the issue-6 bars from an eval summary: per category, each method's speedup,
hf_specdec over the best transformers method that ran, measured over cost-model prediction, and
where hf_specdec's time went (model forwards / processing and sampling around them / everything else).

    python evals/bars.py runs/quick/summary.json
    python evals/bars.py runs/quick/summary.json --methods prompt_lookup hf_specdec
    python evals/bars.py runs/quick/summary.json --modelled    # modelled speedups (the cost table's prices)

Works on any subset of the methods in the summary (default: all of them): the "hf / best
transformers" column takes the best of whichever of assisted, assisted_quantized and prompt_lookup
are shown, and is left out when none is; the hf_specdec columns are left out without hf_specdec.
Reads the summary.json only (no models, no torch).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

TRANSFORMERS_METHODS = ("assisted", "assisted_quantized", "prompt_lookup")
TIME_SPLIT = ("forwards", "processing", "other")


def main(summary_path, methods: list[str] | None = None, modelled: bool = False) -> str:
    """Print (and return) the bars table of the summary at `summary_path`, for `methods` (None: all),
    of wall-clock speedups or, with `modelled`, of modelled ones."""
    summary = json.loads(Path(summary_path).read_text())["summary"]
    text = render(summary, methods, modelled)
    print(text)
    return text


def render(summary: dict, methods: list[str] | None = None, modelled: bool = False) -> str:
    present = list(dict.fromkeys(m for block in summary.values() for m in block))
    if methods is None:  # transformers' methods first, then hf_specdec and its ablations
        methods = [m for m in TRANSFORMERS_METHODS if m in present] + [m for m in present if m not in TRANSFORMERS_METHODS]
    chosen = list(dict.fromkeys(methods))
    missing = [m for m in chosen if m not in present]
    if missing:
        raise SystemExit(f"not in the summary: {', '.join(missing)}; it has {', '.join(present)}")
    lines = []
    for mode, block in summary.items():
        shown = [m for m in chosen if m in block]
        if shown:
            lines += mode_table(mode, block, shown, modelled)
    return "\n".join(lines)


def mode_table(mode: str, block: dict, methods: list[str], modelled: bool = False) -> list[str]:
    """One mode's table, then hf_specdec's acceptance figures and (greedy) which methods matched plain.
    `modelled`: the modelled speedups in the method and "hf / best" columns."""
    key = "median_modelled_speedup" if modelled else "median_speedup"
    baselines = [m for m in methods if m in TRANSFORMERS_METHODS]
    hf = block["hf_specdec"]["categories"] if "hf_specdec" in methods else None
    categories = list(dict.fromkeys(c for m in methods for c in block[m]["categories"]))
    header = ["category", *methods]
    if hf is not None and baselines:
        header.append(f"hf / best of {', '.join(baselines)}")
    if hf is not None:
        header += ["hf predicted", "measured/predicted", "hf time split fwd/proc/other"]
    lines = [f"## {mode}" + (" (modelled)" if modelled else ""), "", _row(header), _row(["---"] * len(header))]
    ratios = []
    for c in categories:
        cells = [c, *(_fmt(_speedup(block, m, c, key), "x") for m in methods)]
        spec = _speedup(block, "hf_specdec", c, key) if hf is not None else None
        if hf is not None and baselines:
            best = max((s for s in (_speedup(block, m, c, key) for m in baselines) if s), default=None)
            ratio = spec / best if spec and best else None
            ratios += [ratio] if ratio else []
            cells.append(_fmt(ratio))
        if hf is not None:
            cells += _hf_cells(hf.get(c, {}), spec)
        lines.append(_row(cells))
    total = "geomean_modelled_speedup" if modelled else "geomean_speedup"
    geomean = ["**geomean**", *(_fmt(block[m].get(total), "x") for m in methods)]
    if hf is not None and baselines:
        geomean.append(_fmt(statistics.geometric_mean(ratios) if ratios else None))
    lines += [_row(geomean + [""] * (len(header) - len(geomean))), ""]
    if hf is not None:
        lines += _hf_acceptance(hf)
    if mode == "greedy":
        matched = {m: all(e.get("all_match_plain", False) for e in block[m]["categories"].values()) for m in methods}
        lines += ["greedy output identical to plain: " + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in matched.items()), ""]
    return lines


def _hf_cells(entry: dict, spec: float | None) -> list[str]:
    predicted = entry.get("predicted_speedup")
    split = entry.get("time_split")
    return [
        _fmt(predicted, "x"),
        _fmt(spec / predicted if spec and predicted else None),
        "/".join(f"{split[k]:.2f}" for k in TIME_SPLIT) if split else "-",
    ]


def _hf_acceptance(hf: dict) -> list[str]:
    lines = [_row(["hf_specdec category", "acceptance", "tokens / target fwd", "n-gram rounds", "plain rounds", "rounds"]),
             _row(["---"] * 6)]
    for c, e in hf.items():
        if "error" not in e:
            lines.append(_row([c, _fmt(e.get("acceptance_rate")), _fmt(e["tokens_per_target_forward"]),
                               str(e.get("ngram_rounds", "-")), str(e.get("plain_rounds", "-")), str(e.get("rounds", "-"))]))
    return lines + [""]


def _speedup(block: dict, method: str, category: str, key: str = "median_speedup") -> float | None:
    """The method's median speedup (`key`: wall or modelled) on the category; None where it did not
    run or failed there."""
    return block[method]["categories"].get(category, {}).get(key)


def _fmt(value: float | None, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.2f}{suffix}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(" ".join(str(c).replace("|", "\\|").split()) for c in cells) + " |"  # a category may hold |


def summary_file(text: str) -> str:
    """argparse type: a summary.json of run_eval's (not its records.jsonl), named in one line otherwise."""
    try:
        data = json.loads(Path(text).read_text())
    except (OSError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"{text}: not a readable summary.json ({error})") from None
    if not isinstance(data, dict) or "summary" not in data:
        raise argparse.ArgumentTypeError(f"{text}: not a summary.json written by evals/run_eval.py (no 'summary')")
    return text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summary", type=summary_file, help="summary.json written by evals/run_eval.py")
    parser.add_argument("--methods", nargs="+", default=None, metavar="METHOD", help="the columns to show (default: all)")
    parser.add_argument("--modelled", action="store_true", help="modelled speedups instead of wall-clock ones")
    args = parser.parse_args()
    main(args.summary, args.methods, args.modelled)

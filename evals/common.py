"""What the eval scripts share: prompts, the model pair, forward timing, and the one definition of
each figure they report (speedup over plain, pooled acceptance, geometric mean), and the library as
it was at an earlier git revision, for old-against-new runs.

evals/ is a folder of scripts, not a package: each script puts this folder on sys.path and imports
from here, so a figure computed by two scripts is computed by one function.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import statistics
import subprocess
import sys
import tarfile
import time
from io import BytesIO
from pathlib import Path

import torch

import hf_specdec
from hf_specdec.pair import DRAFT, TARGET, check_same_vocabulary, load_model

HERE = Path(__file__).resolve().parent
SPEC_BENCH = HERE / "data" / "spec_bench" / "question.jsonl"
HUMANEVAL = HERE / "data" / "humaneval" / "HumanEval.jsonl"
# Spec-Bench's evaluation groups MT-bench's eight categories as one task, "mt_bench".
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
# The two decoding modes every eval script compares: greedy, and sampling as a chat model is used.
MODES = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, temperature=0.7, top_p=0.95)}
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "humaneval")


# ---------------------------------------------------------------- prompts and models


def check_categories(categories) -> None:
    unknown = set(categories) - set(CATEGORIES)
    if unknown:
        raise SystemExit(f"unknown category {sorted(unknown)}; choose from {', '.join(CATEGORIES)}")


# Held-out discipline: every prompt belongs to one split, by the parity of the number in its id
# (Spec-Bench "81" -> 81, HumanEval "HumanEval/2" -> 2): even ids are the tuning split, on which any
# default or threshold of the project is tuned; odd ids are the report split, on which the eval
# reports by default. Fixed, documented, and the same on every machine.
SPLITS = ("report", "tuning", "all")


def split_of(prompt_id: str) -> str:
    """"tuning" or "report" for a prompt id ending in a number."""
    digits = "".join(ch for ch in prompt_id.rsplit("/", 1)[-1] if ch.isdigit())
    if not digits:
        raise ValueError(f"prompt id {prompt_id!r} has no number to split on")
    return "tuning" if int(digits) % 2 == 0 else "report"


def prompt_pools(categories, split: str = "all") -> dict[str, list[tuple[str, str]]]:
    """Per category, (prompt id, text) of every prompt of `split`, in file order."""
    from datasets import load_dataset

    check_categories(categories)
    if split not in SPLITS:
        raise SystemExit(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
    pools = {c: [] for c in categories}
    for row in load_dataset("json", data_files=str(SPEC_BENCH), split="train"):
        category = "mt_bench" if row["category"] in MT_BENCH else row["category"]
        if category in pools:
            pools[category].append((str(row["question_id"]), row["turns"][0]))
    if "humaneval" in pools:
        for row in load_dataset("json", data_files=str(HUMANEVAL), split="train"):
            text = f"Complete the following Python function.\n\n```python\n{row['prompt']}```"
            pools["humaneval"].append((row["task_id"], text))
    if split == "all":
        return pools
    return {c: [(i, t) for i, t in pool if split_of(i) == split] for c, pool in pools.items()}


def _chat_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user turn of the tokenizer's chat template, ready for the assistant's answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"][0].tolist()


def load_prompts(tokenizer, categories, per_category: int | None, split: str = "all") -> list[dict]:
    """Chat-formatted prompts of `split`, `per_category` of each category (None: all), evenly spaced
    through the file so that a small preset still samples the whole category."""
    prompts = []
    for category, pool in prompt_pools(categories, split).items():
        n = len(pool) if per_category is None else min(per_category, len(pool))
        for i in range(n):
            prompt_id, text = pool[(i * len(pool)) // n]
            prompts.append(dict(id=prompt_id, category=category, input_ids=_chat_ids(tokenizer, text)))
    return prompts


PROMPT_FILES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
TEXT_COLUMNS = ("prompt", "text", "question", "instruction", "turns")  # the first present holds the prompt
ID_COLUMNS = ("id", "question_id", "task_id")


def _label(value) -> str | None:
    """An id or category cell as text: None for an empty cell; 3 for the 3.0 a CSV column with gaps reads."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def read_prompt_file(path, categories=None, per_category: int | None = None) -> list[tuple[str, str, str]]:
    """(id, category, text) of one's own prompts: a local .jsonl, .json, .csv or .parquet file read
    through `datasets` (the prompt in a column named one of TEXT_COLUMNS, a list's first item for
    `turns`; an optional `category` column, else "custom"; an optional id column, else file/row), or a
    .txt file of one prompt a line (blank lines skipped). Text files are UTF-8 (a BOM is dropped).
    `categories` keeps those only (None: all); `per_category` takes each category's first that many
    (None: all). Anything unreadable, an empty prompt or a repeated id is named in one line (records
    are paired with plain decoding by id)."""
    path = Path(path)
    builder = PROMPT_FILES.get(path.suffix.lower())
    if builder is None:
        raise SystemExit(f"--prompts {path}: give a {', '.join(PROMPT_FILES)} file")
    rows, columns = _prompt_rows(path, builder)
    column = next((c for c in TEXT_COLUMNS if c in columns), None)
    if column is None:
        raise SystemExit(f"--prompts {path}: no prompt column (one of {', '.join(TEXT_COLUMNS)}); it has {columns}")
    id_column = next((c for c in ID_COLUMNS if c in columns), None)
    out, counts, seen = [], {}, {}
    for i, row in enumerate(rows, start=1):
        text = row[column][0] if isinstance(row[column], list) and row[column] else row[column]
        if builder == "text" and not (text or "").strip():
            continue
        if not isinstance(text, str) or not text.strip():
            what = "no prompt text" if text is None or isinstance(text, str) else f"a {type(text).__name__}, not text,"
            raise SystemExit(f"--prompts {path}: row {i} has {what} in column {column!r}")
        category = _label(row.get("category")) or "custom"
        prompt_id = (_label(row[id_column]) if id_column else None) or f"{path.stem}/{i}"
        if prompt_id in seen:
            raise SystemExit(f"--prompts {path}: rows {seen[prompt_id]} and {i} share the id {prompt_id!r}; ids must be "
                             "unique (each prompt is paired with its own plain decoding by id)")
        seen[prompt_id] = i
        if (categories and category not in categories) or counts.get(category, 0) == per_category:
            continue
        counts[category] = counts.get(category, 0) + 1
        out.append((prompt_id, category, text))
    if not out:
        found = sorted({_label(r.get("category")) or "custom" for r in rows})
        raise SystemExit(f"--prompts {path}: no prompts" + (f" in categories {list(categories)} (it has {found})"
                                                             if categories else ""))
    return out


def _prompt_rows(path: Path, builder: str) -> tuple[list[dict], list[str]]:
    """(rows, column names) of a prompt file read by `datasets`' `builder`; an empty file, a text file
    that is not UTF-8 (pyarrow's error came from the middle of the rows, or datasets named no cause)
    or one datasets cannot read is named in one line. A .txt file's BOM is dropped."""
    from datasets import load_dataset

    data = path.read_bytes()
    if not data:
        raise SystemExit(f"--prompts {path}: the file is empty")
    if builder != "parquet":
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise SystemExit(f"--prompts {path}: not UTF-8 text (byte 0x{data[err.start]:02x} on line {line}: "
                             f"{err.reason}); save it as UTF-8") from None
    try:
        dataset = load_dataset(builder, data_files=str(path), split="train")
        rows, columns = dataset.to_list(), dataset.column_names
    except Exception as err:  # a malformed file: datasets' own error names neither it nor the cause
        cause = err.__cause__ or err  # datasets' DatasetGenerationError wraps the reader's error
        first = str(cause).splitlines()[0] if str(cause) else "empty or malformed"
        raise SystemExit(f"--prompts {path}: datasets could not read it as {builder} ({type(cause).__name__}: "
                         f"{first})") from None
    if builder == "text" and rows and rows[0]["text"]:
        rows[0]["text"] = rows[0]["text"].removeprefix("\ufeff")  # datasets keeps a UTF-8 BOM as text
    return rows, columns


def load_prompt_file(tokenizer, path, categories=None, per_category: int | None = None) -> list[dict]:
    """`read_prompt_file`'s prompts, chat-formatted like the presets'."""
    return [dict(id=i, category=c, input_ids=_chat_ids(tokenizer, t)) for i, c, t in read_prompt_file(path, categories, per_category)]


def load_pair(target_name: str, draft_name: str, device, device_map=None, pack: bool = False, draft_bits: int = 8):
    """(target, draft, tokenizer): the named pair, or the tiny offline pair of `tiny.py` for "tiny".
    pack: both models in float32 with oneDNN-packed linears (`hf_specdec.pack_linears`), for every
    method alike: on CPUs without bf16 instructions, where a bf16 forward over k tokens costs nearly k
    steps (the draft too: its prompt encoding and catch-ups are forwards over many tokens). With
    `draft_bits` 8 the packed draft also gets int8 copies for its one-token steps (`decode_bits=8`);
    `drafts_by_precision` gives the draft without them to the methods that take the draft as loaded."""
    if (target_name == "tiny") != (draft_name == "tiny"):  # the tiny pair is one pair: a named folder is not dropped
        raise ValueError(f"'tiny' names the offline pair, target and draft together: got --target {target_name} and "
                         f"--draft {draft_name} (give --target tiny --draft tiny, or two real models)")
    if target_name == "tiny":
        from tiny import tiny_pair

        target, draft, tokenizer = tiny_pair()
        target, draft = target.to(device), draft.to(device)
    else:
        target, tokenizer = load_model(target_name, device=device, device_map=device_map)
        draft, draft_tokenizer = load_model(draft_name, device=target.device)
        check_same_vocabulary(tokenizer, draft_tokenizer, target, draft)
    if pack:
        from hf_specdec.cpu import pack_linears

        pack_linears(target)
        pack_draft(draft, draft_bits)  # int8 copies for its one-token steps
    return target, draft, tokenizer


PACK_HELP = ("both models in float32 with oneDNN-packed linears (hf_specdec.pack_linears) for every method: on CPUs "
             "without bf16 instructions a bf16 forward over k tokens costs nearly k steps (hf_specdec's draft then "
             "keeps int8 copies for its one-token steps with --draft-bits 8, none with 4 or 16)")


# ---------------------------------------------------------------- argument types: bad input fails in one line, before loading


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def draft_length(text: str) -> int:
    """--num-draft-tokens: 1 to hf_specdec's MAX_DRAFT_TOKENS (every hf_specdec call refuses a longer one)."""
    from hf_specdec.config import MAX_DRAFT_TOKENS

    value = positive_int(text)
    if value > MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_DRAFT_TOKENS} (hf_specdec.config.MAX_DRAFT_TOKENS), "
                                         f"got {text!r}")
    return value


def threads_count(text: str) -> int:
    try:
        value = 0 if text.strip() == "0" else positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be 0 (torch's default) or a positive integer, got {text!r}") from None
    from hf_specdec.cli import too_many_threads

    if (problem := too_many_threads(value)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def model_name(text: str) -> str:
    """--target / --draft: 'tiny', a registry name or hub id, or a local model folder that exists (transformers
    would take a missing folder for a hub id)."""
    from hf_specdec.pair import check_local_model

    if text != "tiny":
        try:
            check_local_model(text)
        except Exception as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text


def existing_path(text: str) -> str:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text} does not exist")
    return text


def cost_table_file(text: str) -> str:
    """A path that reads as a cost table (`costs.load_table`), checked before any model loads."""
    from costs import load_table

    try:
        load_table(Path(existing_path(text)))
    except argparse.ArgumentTypeError:
        raise
    except Exception as err:  # malformed JSON, missing fields
        raise argparse.ArgumentTypeError(f"{text} is not a cost table: {type(err).__name__}: {err}") from None
    return text


def out_folder(text: str) -> str:
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; --out names a folder")
    return text


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


# ---------------------------------------------------------------- the options the scripts share

REQUIRED = object()  # add_options(parser, out=REQUIRED): the option must be given
OPTIONS = {  # each shared option, defined once: (flag, argparse settings)
    "target": ("--target", dict(type=model_name, default=TARGET.name, help="registry name, local folder, hub id, or 'tiny'")),
    "draft": ("--draft", dict(type=model_name, default=DRAFT.name, help="registry name, local folder, hub id, or 'tiny' (with --target tiny)")),
    "draft_bits": ("--draft-bits", dict(type=int, choices=(4, 8, 16), default=8,
                                        help="weight-only quantization of hf_specdec's draft (16: none; default int8)")),
    "pack": ("--pack", dict(action="store_true", help=PACK_HELP)),
    "threads": ("--threads", dict(type=threads_count, default=0, help="torch threads (0: torch's default)")),
    "out": ("--out", dict(type=out_folder, default=None, help="the folder the outputs are written to")),
    "cost_table": ("--cost-table", dict(type=cost_table_file, default=None,
                                        help="a cost_table.json: prices the work and pins hf_specdec's costs")),
}


def add_options(parser, *names: str, **defaults) -> None:
    """Adds the named shared options (`OPTIONS`) to `parser`; a keyword gives one of them another
    default (`out="runs/x"`), or makes it required (`out=REQUIRED`)."""
    for name in (*names, *(n for n in defaults if n not in names)):
        flag, settings = OPTIONS[name]
        settings = dict(settings)
        if name in defaults:
            if defaults[name] is REQUIRED:
                settings.pop("default", None)
                settings["required"] = True
            else:
                settings["default"] = defaults[name]
        parser.add_argument(flag, **settings)


def apply_threads(threads: int) -> None:
    """`--threads`: torch's thread count, when given (0 keeps torch's default)."""
    if threads:
        torch.set_num_threads(threads)


def pack_draft(draft, draft_bits: int = 8):
    """The draft packed as every eval script packs hf_specdec's: with int8 copies for its one-token
    steps under `draft_bits` 8, none otherwise."""
    from hf_specdec.cpu import pack_linears

    return pack_linears(draft, decode_bits=8 if draft_bits == 8 else None)


def hf_draft(draft, bits: int):
    """The draft hf_specdec uses: `draft` itself at 16 bits or when packed (`load_pair(pack=True)`
    packed it as `bits` asks), else a copy weight-only quantized to `bits`."""
    from hf_specdec.cpu import PackedLinear

    if bits == 16 or any(isinstance(m, PackedLinear) for m in draft.modules()):
        return draft
    from hf_specdec.quantize import quantize_weights

    return quantize_weights(copy.deepcopy(draft), bits, group_size=32)  # as the CLI's --draft-bits (int4 in groups of 32)


def drafts_by_precision(draft, bits: int) -> dict:
    """{"bf16": the draft as loaded, "hf": the one hf_specdec uses (`hf_draft`)}. A packed draft with
    int8 decode copies: "bf16" is a copy without them (sharing the packed weights). Callers that need
    only "hf" call `hf_draft` (no copy made)."""
    from hf_specdec.cpu import without_decode_copies

    return {"bf16": without_decode_copies(draft), "hf": hf_draft(draft, bits)}


# ---------------------------------------------------------------- timing


class ForwardTimer:
    """Counts and times every forward of the given models (public nn.Module hooks; nothing patched),
    and notes each forward's work: (new tokens, tokens already cached). On CUDA the hooks
    synchronise, so a forward's time is its kernels' time, not its launch time."""

    def __init__(self, *models: torch.nn.Module):
        self.durations: list[float] = []
        self.work: list[list[int]] = []  # [width, context] per forward
        self._start = 0.0
        self.cuda = any(m.device.type == "cuda" for m in models)
        for model in dict.fromkeys(models):  # the same model once
            model.register_forward_pre_hook(self._pre, with_kwargs=True)
            model.register_forward_hook(self._post)

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, module, args, kwargs):
        ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
        cache = kwargs.get("cache")
        self.work.append([ids.shape[1], 0 if cache is None else cache.get_seq_length()])
        self._start = self._now()

    def _post(self, module, args, output):
        self.durations.append(self._now() - self._start)

    def take(self) -> list[float]:
        """The forward durations since the last take (their work is dropped)."""
        return self.take_with_work()[0]

    def take_with_work(self) -> tuple[list[float], list[list[int]]]:
        """(durations, [width, context] per forward) since the last take."""
        out = self.durations, self.work
        self.durations, self.work = [], []
        return out


def with_scored(work: dict, rounds: list) -> dict:
    """`work` with "scored" (`CostTable.modelled_seconds`): per round of an hf_specdec call (its
    `RoundRecord`s, one per row), the positions its target forward scored; `work` unchanged where the
    rounds and the target's forwards do not pair one to one."""
    scored: dict[int, int] = {}
    for r in rounds:
        scored[r.round] = max(scored.get(r.round, 0), r.scored)
    if not scored or len(scored) != len(work.get("target", ())) or min(scored.values()) < 1:
        return work
    return {**work, "scored": [scored[i] for i in sorted(scored)]}


def step_time(durations: list[float]) -> float | None:
    """Median forward time excluding the first (the prefill, which costs more than a decode step)."""
    return statistics.median(durations[1:]) if len(durations) > 1 else None


# ---------------------------------------------------------------- figures


def speedup_over_plain(new_tokens: int, seconds: float, plain_new_tokens: int, plain_seconds: float) -> float:
    """(tokens / s of a method) / (tokens / s of plain decoding), on the same prompt and mode.

    A throughput ratio, not a time ratio: under sampling the two outputs may differ in length (or a
    batch row may stop early), so plain seconds / method seconds would credit a method for merely
    stopping sooner. Under greedy the outputs match and the two definitions agree.
    """
    return (new_tokens / seconds) / (plain_new_tokens / plain_seconds)


COUNTS = ("rounds", "drafted", "accepted", "emitted")
PER_POSITION = ("drafted_per_position", "reached_per_position", "accepted_per_position")


def pooled_stats(rows: list[dict]) -> hf_specdec.AcceptanceStats:
    """hf_specdec.AcceptanceStats summed over records, so that every acceptance figure of every
    script (acceptance_rate = accepted / drafted, token_acceptance = accepted / reached, tokens per
    round, per-position rates) is the library's own definition, pooled over prompts (a per-prompt
    mean would weigh a 3-token answer like a 64-token one).

    A record that logs its rounds (`round_log`: (drafted, accepted, emitted) per round, hf_specdec in
    run_eval.py) is replayed round by round; otherwise the counters it carries are added (the
    analyses' records; transformers' assisted methods, which carry drafted and accepted only).
    """
    stats = hf_specdec.AcceptanceStats()
    for r in rows:
        if "round_log" in r:
            for drafted, accepted, emitted in r["round_log"]:
                stats.rounds += 1
                stats.record(drafted, accepted, emitted)
            continue
        for name in COUNTS:
            setattr(stats, name, getattr(stats, name) + r.get(name, 0))
        for name in PER_POSITION:
            setattr(stats, name, _add_lists(getattr(stats, name), r.get(name, [])))
    return stats


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


def round_log(rounds: list[hf_specdec.RoundRecord]) -> list[tuple[int, int, int]]:
    """What a record keeps of each round, (drafted, accepted, emitted): enough for `pooled_stats`. A tree
    round counts its depth as drafted, as the library's AcceptanceStats do (the most it could accept)."""
    from hf_specdec.proposals.tree import tree_depth

    return [(len(r.draft_tokens) if r.parents is None else tree_depth(r.parents), r.num_accepted, len(r.emitted_tokens))
            for r in rounds]


def tree_counts(rounds: list[hf_specdec.RoundRecord]) -> dict:
    """What a record keeps of its tree rounds: how many, their nodes and accepted path lengths in
    all, and accepted tokens by where they came from (chains and trees alike)."""
    trees = [r for r in rounds if r.parents is not None]
    accepted_from: dict[str, int] = {}
    for r in rounds:
        if r.accepted_from:
            accepted_from[r.accepted_from] = accepted_from.get(r.accepted_from, 0) + r.num_accepted
    return dict(
        tree_rounds=len(trees), tree_nodes=sum(len(r.draft_tokens) for r in trees),
        tree_path=sum(r.num_accepted for r in trees), accepted_from=accepted_from,
    )


def geometric_mean(values) -> float | None:
    """Over the positive values given (a missing or failed category is skipped, not counted as 0)."""
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def bootstrap_interval(groups: list[list[float]], statistic, level: float = 0.9, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of `statistic(groups)`, resampling the values within each group
    with replacement (prompts within categories). `statistic` takes a list of groups."""
    import random

    if not groups or any(not g for g in groups):
        return None
    rng = random.Random(seed)
    values = sorted(statistic([rng.choices(g, k=len(g)) for g in groups]) for _ in range(resamples))
    tail = (1 - level) / 2
    return values[int(tail * (resamples - 1))], values[int((1 - tail) * (resamples - 1))]


def median_interval(values: list[float], level: float = 0.9) -> tuple[float, float] | None:
    """Bootstrap interval of the median over prompts."""
    return bootstrap_interval([values], lambda groups: statistics.median(groups[0]), level)


def geomean_of_medians_interval(groups: list[list[float]], level: float = 0.9) -> tuple[float, float] | None:
    """Bootstrap interval of the geometric mean over categories of the per-category median."""
    return bootstrap_interval(groups, lambda gs: geometric_mean(statistics.median(g) for g in gs), level)


def median_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def import_baseline(revision: str, folder: Path):
    """hf_specdec as it was at `revision`, importable as `hf_specdec_baseline` (relative imports
    inside the package keep working under the new name)."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent).stdout.strip()
    archive = subprocess.run(["git", "archive", revision, "hf_specdec"], capture_output=True, check=True, cwd=root).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "hf_specdec").rename(folder / "hf_specdec_baseline")
    sys.path.insert(0, str(folder))
    return importlib.import_module("hf_specdec_baseline")

"""The cost table: what each kind of work costs on this machine, and a record's modelled time.

Wall-clock speedups on a shared machine move 10-30% between runs. The work a method does does not:
its forwards (how many, how wide, over how much context) and the positions it processes depend only
on the tokens. So a run measures once, at its start (and again at its end, to see drift), what each
kind of work costs, and prices every record's counted work with that table:

* a target or draft forward of w new tokens over a cache of c tokens, for a grid of w and c
  (linear interpolation between grid points, linear extrapolation beyond);
* a forward from an empty cache (a prefill) of n tokens, for a grid of n;
* processing and sampling one scored position, per mode and per engine: transformers' own
  processors and sampler (plain decoding, assisted generation, prompt lookup) or hf_specdec's.

modelled seconds = sum over forwards of their price + positions x the position price, where a
forward from an empty cache scores one position and any other forward one per new token.
modelled speedup = (new tokens / modelled seconds) / (plain's new tokens / plain's modelled seconds).

The table also gives hf_specdec pinned costs (`pinned_costs`): the draft/target step ratio and each
verify width's price (with the mode's price per scored position), so that its cost model decides
from the table, not from the clock, and a run repeats exactly (tokens, rounds, modelled time).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import hf_specdec

WIDTHS = (1, 2, 3, 5, 9, 17, 33)  # new tokens in a forward: plain, k + 1 for k up to 8, n-gram proposals
CONTEXTS = (64, 256, 1024)  # cached tokens
PREFILLS = (16, 64, 256, 1024)  # prompt tokens
ENGINES = ("transformers", "hf_specdec")
PIN_POSITION = True  # pinned costs tell the planner a sampled position's price (False: `--eager-prices`, the old pins)


@dataclass
class CostTable:
    """Seconds per unit of work, measured on this machine (see the module docstring). Models are named:
    "target", and each draft by the name the eval gives it ("hf" for hf_specdec's quantized draft,
    "bf16" for the draft as loaded)."""

    widths: list[int]
    contexts: list[int]
    forwards: dict[str, list[list[float]]]  # [model][context][width]: one forward over a cache
    prefills: list[int]
    prefill: dict[str, list[float]]  # [model][prefill]: one forward from an empty cache
    position: dict[str, dict[str, float]] = field(default_factory=dict)  # [mode][engine]: one scored position

    def forward(self, model: str, width: int, context: int) -> float:
        """One forward of `model` over `width` new tokens and `context` cached ones."""
        if context == 0:
            return _interp(self.prefills, self.prefill[model], width)
        at_contexts = [_interp(self.widths, row, width) for row in self.forwards[model]]
        return _interp(self.contexts, at_contexts, context)

    def modelled_seconds(self, work: dict[str, list], mode: str, engine: str) -> float:
        """work: {model: [[width, context], ...]}, every forward of one generate call, and where known
        "scored": the positions each target forward scored (hf_specdec's `RoundRecord.scored`: its lazy
        rule stops at the first rejection when sampling on a CPU). Without it a target forward scores one
        position from an empty cache and one per new token otherwise; a draft forward scores one."""
        seconds, positions = 0.0, 0
        for model, forwards in work.items():
            for width, context in forwards if model != "scored" else ():
                seconds += self.forward(model, width, context)
                positions += width if model == "target" and context > 0 and "scored" not in work else 1
        if "scored" in work:
            positions += sum(work["scored"]) - len(work["scored"])  # each target forward was counted once above
        return seconds + positions * self.position[mode][engine]

    def pinned_costs(self, context: int, draft: str = "hf", window: int | None = 256, mode: str | None = None) -> dict:
        """hf_specdec's prices at `context`, as the keyword argument `costs=` (an `hf_specdec.Costs`):
        the draft step over the target step, every verify width's price up to the widest measured,
        and the draft's prefill per token (over the prompt's last `window` tokens; None: the whole
        prompt); all over the target step. With `mode`, each scored position's processing is priced as
        `modelled_seconds` prices it (a target forward over w tokens scores up to w positions, a draft
        step and a plain step one): in sampling on this CPU a position costs about 1% of a step for
        hf_specdec (top-k 50 and top-p, `evals/results/top-k-positions/`; 7% in tables timed without
        the top-k), so a long lookup chain is dearer than its forward alone; and, when sampling,
        that price is also given apart (`Costs.position`), so the planner pays for the positions past
        the lazy rule's first chunk only as likely as they are reached."""
        position = self.position[mode]["hf_specdec"] if mode else 0.0
        step = self.forward("target", 1, context) + position
        curve = tuple(round((self.forward("target", w, context) + w * position) / step, 4)
                      for w in range(1, self.widths[-1] + 1))
        encoded = min(context, window or context)  # the tokens the draft's prefill encodes
        return dict(costs=hf_specdec.Costs(draft_step=(self.forward(draft, 1, context) + position) / step, verify=curve,
                                           draft_prefill=self.forward(draft, encoded, 0) / encoded / step,
                                           position=round(position / step, 4) if mode not in (None, "greedy") and PIN_POSITION else 0.0))

    def alias(self, name: str, like: str) -> None:
        """Price model `name` as `like` (a draft of the same architecture and precision)."""
        self.forwards[name], self.prefill[name] = self.forwards[like], self.prefill[like]

    @classmethod
    def mean(cls, tables: list["CostTable"]) -> "CostTable":
        """The elementwise mean of tables measured on the same grid (runs on different days or machines)."""
        first = tables[0]
        if any((t.widths, t.contexts, t.prefills) != (first.widths, first.contexts, first.prefills) for t in tables):
            raise ValueError("tables measured on different grids cannot be averaged")
        avg = lambda values: sum(values) / len(values)  # noqa: E731
        return cls(
            widths=first.widths, contexts=first.contexts, prefills=first.prefills,
            forwards={m: [[avg(cells) for cells in zip(*rows)] for rows in zip(*(t.forwards[m] for t in tables))]
                      for m in first.forwards},
            prefill={m: [avg(cells) for cells in zip(*(t.prefill[m] for t in tables))] for m in first.prefill},
            position={mode: {e: avg([t.position[mode][e] for t in tables]) for e in first.position[mode]}
                      for mode in first.position},
        )

    def drift(self, other: "CostTable") -> float:
        """Largest relative difference between two tables' forward prices (start against end of a run)."""
        pairs = [(a, b) for model in self.forwards for ra, rb in zip(self.forwards[model], other.forwards[model])
                 for a, b in zip(ra, rb)]
        pairs += [(a, b) for model in self.prefill for a, b in zip(self.prefill[model], other.prefill[model])]
        return max(abs(b - a) / a for a, b in pairs if a > 0)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> "CostTable":
        return cls(**json.loads(Path(path).read_text()))


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys), extended linearly beyond both ends (never below 0)."""
    if len(xs) == 1:
        return ys[0]
    i = 1
    while i < len(xs) - 1 and x > xs[i]:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


# ---------------------------------------------------------------- measuring


@torch.no_grad()
def _time_forward(model, cache, ids: torch.Tensor, logits: int) -> float:
    """Seconds of one forward of `model` over `ids` [1, w] on top of `cache` (cut back after it),
    computing logits at the last `logits` positions."""
    from hf_specdec.cache import rollback

    base = cache.get_seq_length()
    sync(ids.device)
    start = time.perf_counter()
    model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=logits)
    sync(ids.device)
    seconds = time.perf_counter() - start
    rollback([cache], base)
    return seconds


def _forward_grid(model, vocab: int, widths, contexts, reps: int, gen: torch.Generator, all_logits: bool) -> list[list[float]]:
    """[context][width] seconds: the median of `reps` passes over the whole grid (one forward per
    cell a pass), so that a slow spell of a shared machine lands in one pass, not in all of one
    cell's timings (three back-to-back timings a cell had priced a 64-token context's one-token step
    at twice the 256-token context's, 581 against 290 ms: `sampling-trees-vs-chains/cost_table.json`).
    A verifying target scores every new token (`all_logits`); a draft catching up on several tokens
    scores only the last."""
    from hf_specdec.cache import new_cache

    device, caches = model.device, []
    for context in contexts:
        cache = new_cache(model)
        model(input_ids=torch.randint(4, vocab, (1, context), generator=gen).to(device), cache=cache, use_cache=True,
              logits_to_keep=1)
        caches.append(cache)
    ids = {w: torch.randint(4, vocab, (1, w), generator=gen).to(device) for w in widths}
    times = [[[] for _ in widths] for _ in contexts]
    for _ in range(reps):
        for i, cache in enumerate(caches):
            for j, w in enumerate(widths):
                times[i][j].append(_time_forward(model, cache, ids[w], logits=w if all_logits else 1))
    return [[statistics.median(cell) for cell in row] for row in times]


def _prefills(model, vocab: int, lengths, reps: int, gen: torch.Generator) -> list[float]:
    """Seconds of a forward from an empty cache over n tokens, with logits at the last position only
    (the median of `reps` passes over the lengths)."""
    from hf_specdec.cache import new_cache

    ids = {n: torch.randint(4, vocab, (1, n), generator=gen).to(model.device) for n in lengths}
    times = {n: [] for n in lengths}
    for _ in range(reps):
        for n in lengths:
            times[n].append(_time_forward(model, new_cache(model), ids[n], logits=1))
    return [statistics.median(times[n]) for n in lengths]


def position_seconds(processors: dict[str, object], vocab: int, device, reps: int = 20,
                     logits: torch.Tensor | None = None) -> dict[str, float]:
    """Seconds to process one position's logits and pick its token, per engine (callables taking
    [1, vocab] logits and returning a token). `logits`: real positions ([n, vocab], `recorded_logits`),
    taken in turn; without them Gaussian logits, whose flat tail no language model has (a top-p
    that looks only at the top of the order cannot stop early on them)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for engine, pick in processors.items():
        rows = (torch.randn(1, vocab, generator=gen) * 3).to(device) if logits is None else logits.to(device)
        pick(rows[:1])  # warm-up
        sync(rows.device)
        start = time.perf_counter()
        for i in range(reps):
            pick(rows[i % rows.shape[0]][None])
        sync(rows.device)
        out[engine] = (time.perf_counter() - start) / reps
    return out


def recorded_logits(target, tokenizer) -> torch.Tensor:
    """The target's logits ([n, vocab], float32) at the positions of the standard preset's recorded
    plain-sampling outputs (`evals/results/standard/records.jsonl`), one prompt a category: what a
    position's processors see in the runs, for `position_seconds`."""
    from common import load_prompts

    records = [json.loads(line) for line in (Path(__file__).parent / "results/standard/records.jsonl").open()]
    first = {}
    for r in records:
        if r["mode"] == "sampling" and r["method"] == "plain":
            first.setdefault(r["category"], r)
    prompts = {p["id"]: p for p in load_prompts(tokenizer, sorted(first), None, "all")}
    rows = []
    with torch.no_grad():
        for r in first.values():
            ids = torch.tensor([prompts[r["id"]]["input_ids"] + r["tokens"]], device=target.device)
            rows.append(target(ids).logits[0, -len(r["tokens"]) - 1 : -1].float())
    return torch.cat(rows)


def sync(device) -> None:
    """Wait for a CUDA device's queued work (a timing's edges); nothing elsewhere."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def generate_processors(model, mode_kwargs: dict):
    """The LogitsProcessorList generate() builds for a call with `mode_kwargs`: transformers fills in
    what a call leaves out (top-k 50 under do_sample=True unless top_k is given), so the processors a
    position runs are read from generate() itself, through a custom_generate that records them."""
    seen = []

    def record(model, input_ids, logits_processor=None, **ignored):
        seen.append(logits_processor)
        return input_ids

    ids = torch.ones(1, 1, dtype=torch.long, device=model.device)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, custom_generate=record, **mode_kwargs)
    return seen[0]


def position_pickers(model, mode_kwargs: dict) -> dict[str, object]:
    """Per engine, a callable [1, vocab] logits -> token doing what that engine does per position:
    the processors generate() builds for `mode_kwargs` (`generate_processors`) and a multinomial draw
    (or argmax), or hf_specdec's `RowProcessors` path and draw."""
    from hf_specdec.sampling import RowProcessors, logits_to_probs, sample

    ids = torch.zeros(1, 1, dtype=torch.long, device=model.device)
    if not mode_kwargs.get("do_sample"):
        argmax = lambda logits: logits.float().argmax(-1)  # noqa: E731
        return {engine: argmax for engine in ENGINES}
    pipeline = generate_processors(model, mode_kwargs)
    ours = RowProcessors(pipeline, 1)
    return {
        "transformers": lambda logits: torch.multinomial(torch.softmax(pipeline(ids, logits.float()), -1), 1),
        "hf_specdec": lambda logits: sample(logits_to_probs(ours.scores(_prefix(ids), ids[:, :0], logits))),
    }


def _prefix(ids):
    from hf_specdec.sampling import Prefixes

    return Prefixes.from_tensor(ids, [0])


def measure(target, drafts: dict[str, torch.nn.Module], vocab: int, modes: dict[str, dict], reps: int = 5,
            widths=WIDTHS, contexts=CONTEXTS, prefills=PREFILLS, seed: int = 0) -> CostTable:
    """Time every kind of work on this machine: the target and each named draft (a draft given under
    two names is timed once). About a minute a model for the real pair on 2 CPU cores."""
    gen = torch.Generator().manual_seed(seed)
    models = {"target": target, **drafts}
    forwards, prefill, seen = {}, {}, {}
    for name, model in models.items():
        if id(model) in seen:  # the same model under another name
            forwards[name], prefill[name] = forwards[seen[id(model)]], prefill[seen[id(model)]]
            continue
        seen[id(model)] = name
        forwards[name] = _forward_grid(model, vocab, widths, contexts, reps, gen, all_logits=name == "target")
        prefill[name] = _prefills(model, vocab, prefills, reps, gen)
    table = CostTable(widths=list(widths), contexts=list(contexts), forwards=forwards, prefills=list(prefills),
                      prefill=prefill)
    table.position = {mode: position_seconds(position_pickers(target, kwargs), vocab,
                                              target.device)
                      for mode, kwargs in modes.items()}
    return table


def load_table(path: Path) -> "CostTable":
    """A cost table as the replays price with it: a draft not in it (hf_specdec's, as loaded) priced as bf16."""
    table = CostTable.load(Path(path))
    if "hf" not in table.forwards:
        table.alias("hf", "bf16")
    return table


def plain_work(prompt_tokens: int, new_tokens: int) -> dict[str, list[list[int]]]:
    """Plain decoding's forwards for `new_tokens` tokens: a prefill, then one token at a time."""
    if new_tokens < 1:
        return {"target": []}
    return {"target": [[prompt_tokens, 0]] + [[1, prompt_tokens + i] for i in range(new_tokens - 1)]}

"""Continuous batching with speculation: many prompts, a batch kept full.

    results = hf_specdec.generate_continuous(target, prompts, assistant=draft, max_batch_size=8,
                                             max_new_tokens=128, do_sample=True, temperature=0.7)
    results[i].tokens, results[i].acceptance     # prompt i's generated tokens and statistics

`prompts` is a list or any iterable of token id sequences (1-D tensors or lists of ints), or of
mappings {"input_ids": ..., "max_new_tokens": n} for a budget of its own (a serving trace; an
"attention_mask" there drops the padding it marks, as a tokenizer's padded output has it), read
lazily: an iterator may keep yielding prompts while generation runs, and may yield None for "nothing
waiting now" (the loop asks again after the next round). The decode loop is `speculative_generate`
itself, started through `model.generate()` on the first prompt; before every round, waiting prompts
join while the batch has fewer than `max_batch_size` rows, and a row that finishes leaves at once
(its result goes to `on_result`, in the order rows finish). How a row joins (`generate.admit`): the
work sequence is widened if the prompt is longer, the prompt is appended as a left-padded row, and
each cache gets a row holding exactly the columns the others hold: the prompt's tokens among them
encoded by a forward of that model alone, the rest (its last token, or all of it before the first
round) fed with the batch's next forward like any pending token (`cache.add_row`). Each row sees
its own prompt, unpadded, in logits processors and stopping criteria; `max_new_tokens` counts per
prompt. Exact per prompt: every row is verified by the same rule as in a static batch, so greedy
rows equal plain greedy on that prompt alone, sampled rows have the target's law for that prompt.

Faults stay with their request: a prompt that cannot be served (token ids outside the vocabulary, a
shape that is not one sequence, a bad budget, a prompt longer than `max_length`, no room left in a table
of learned positions, as GPT-2's: a row that would run past its last stops there) or whose row makes a stopping criterion raise gets a
`StreamResult` whose `error` holds the exception (tokens generated before it, if any), and every other
prompt completes. If the prompt source or `on_result` raises, no prompt joins after that, the rows
already running finish, and a `StreamError` is raised from the original exception, carrying every
complete result (`.results`) and which requests never started (`.first_not_started`,
`.not_started` when the source had a length). Without `max_new_tokens`, each prompt gets the budget
plain `generate()` would give it alone.

Not for: sliding-window or linear-attention models (rows join by gathering cache columns), a
`draft_window`, trees (batches use chains), streamers, and the processors that count from one
prompt's length (`min_new_tokens`, `begin_suppress_tokens`, `forced_eos_token_id`,
`exponential_decay_length_penalty`; `min_length` counts per row and works).
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Union

import torch
from transformers import GenerationConfig, PreTrainedModel

from .host import to_device
from .stats import AcceptanceStats

# A prompt: token ids, or {"input_ids": token ids, "max_new_tokens": its own budget}; None: none waiting.
PromptItem = Union[Sequence[int], torch.Tensor, Mapping[str, Any], None]

# transformers' max_length when nobody sets one (GenerationConfig's default parameters): generate() then
# gives every prompt this many new tokens, capped by the model's positions.
TRANSFORMERS_DEFAULT_MAX_LENGTH = 20


@dataclass
class StreamResult:
    """One prompt's outcome; `error` is set (and `tokens` holds what came before it) when it failed."""

    index: int  # the prompt's place in the stream, from 0
    prompt: torch.Tensor  # [len] (empty if the item could not be read as token ids)
    tokens: torch.Tensor  # [n]: the generated tokens (through the stopping token, if one stopped it)
    acceptance: AcceptanceStats
    error: BaseException | None = None
    row: int | None = None  # its row in the decode loop: `RoundRecord.row` of its acceptance_sink records (None: never ran)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def sequence(self) -> torch.Tensor:  # [len + n]
        return torch.cat([self.prompt, self.tokens])


class StreamError(RuntimeError):
    """The stream stopped early (its prompt source or `on_result` raised, or the decode loop failed).
    `results`: every complete result, by index; `first_not_started`: the first request that never
    started; `not_started`: their indices when the source had a length, else None."""

    def __init__(self, message: str, results: list[StreamResult], first_not_started: int,
                 not_started: list[int] | None):
        super().__init__(message)
        self.results, self.first_not_started, self.not_started = results, first_not_started, not_started


class Requests:
    """The decode loop's side of continuous batching: prompts waiting to join, results of rows that
    finished. Rows are numbered in the order prompts join; a prompt that cannot be served takes a
    stream index but no row (its result carries the error at once)."""

    def __init__(
        self,
        prompts: Iterable[PromptItem],
        max_batch_size: int,
        device: torch.device | int | str,
        on_result: Callable[[StreamResult], None] | None = None,
        progress: bool = False,
        vocab_size: int | None = None,
        default_length: bool = False,  # nobody set max_length: plain generate()'s default budget per prompt
        max_positions: int | None = None,  # the target's positions (caps that default)
        learned_positions: bool = False,  # a table of absolute positions (GPT-2): none exists past max_positions
        max_length: int | None = None,  # the call's max_length, where no max_new_tokens is set
        pad_token_id: int | None = None,  # a prompt without a mask: its pad ids are padding, as plain generate() infers
    ):
        self.max_batch_size = max_batch_size
        self.device, self.vocab_size = device, vocab_size
        self.default_length, self.max_positions, self.learned_positions = default_length, max_positions, learned_positions
        self.max_length, self.pad_token_id = max_length, pad_token_id
        self.on_result = on_result
        self.total = len(prompts) if hasattr(prompts, "__len__") else None
        self._source: Iterator = iter(prompts)
        self.exhausted = False
        self.stopped: BaseException | None = None  # the source's or on_result's error: nothing joins after it
        self.stopped_by = ""
        self.results: dict[int, StreamResult] = {}
        self.budgets: dict[int, int] = {}  # rows whose prompt came with its own max_new_tokens
        self.stream_index: list[int] = []  # row -> its prompt's place in the stream
        self.failed: dict[int, BaseException] = {}  # rows whose stopping criteria raised
        self.cut: dict[int, tuple[int, BaseException]] = {}  # rows whose budget was cut: (tokens, the error if reached)
        self.admitted = 0  # items read from the source
        self.decoding = False  # whether the decode loop began (set by it)
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, desc="prompts", unit="prompt")

    def _prompt(self, item: PromptItem) -> tuple[torch.Tensor, int | None]:
        """(the prompt as a 1-D tensor, its own budget or None); a ValueError names what is wrong."""
        budget, masked = None, False
        if isinstance(item, Mapping):
            if "input_ids" not in item:
                raise ValueError(f"prompt {self.admitted} is a mapping without 'input_ids'")
            unknown = sorted(map(str, set(item) - {"input_ids", "attention_mask", "max_new_tokens"}))
            if unknown:  # a misspelt budget, or a setting that applies to the whole call only
                raise ValueError(f"prompt {self.admitted} has keys {unknown}: a prompt mapping takes input_ids, "
                                 "attention_mask and max_new_tokens; generation settings are the call's")
            if item.get("max_new_tokens") is not None:
                budget = item["max_new_tokens"]
                if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 1:
                    raise ValueError(f"prompt {self.admitted}: max_new_tokens must be a positive integer, got {budget!r}")
                budget = int(budget)
            masked = item.get("attention_mask") is not None
            item = _unpadded(item, self.admitted)
        if isinstance(item, (str, bytes)):
            raise ValueError(f"prompt {self.admitted} is text; pass token ids (tokenize it first)")
        try:
            prompt = torch.as_tensor(item, device=self.device)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"prompt {self.admitted} is not a sequence of token ids: {error}") from None
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() == 0:
            raise ValueError(f"prompt {self.admitted} is one number ({item!r}), not a sequence of token ids: prompts is "
                             "an iterable of prompts, so one prompt is passed as [prompt]")
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(
                f"prompt {self.admitted} must be a non-empty sequence of token ids (1-D), got shape {tuple(prompt.shape)}"
            )
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise ValueError(f"prompt {self.admitted} must hold integer token ids, got {prompt.dtype}")
        prompt = prompt.long()
        if self.pad_token_id is not None and not masked:
            prompt = self._unpadded_by_id(prompt)
        if self.max_positions is not None and (  # rotary positions go on, as in plain generate()
                (self.learned_positions and prompt.numel() > self.max_positions)  # its first new token needs no row
                or (self.default_length and budget is None and prompt.numel() >= self.max_positions)):
            raise ValueError(f"prompt {self.admitted} has {prompt.numel()} tokens: no room left in the target's "
                             f"{self.max_positions} positions")
        if budget is None and self.max_length is not None and prompt.numel() >= self.max_length:  # plain generate() raises
            raise ValueError(f"prompt {self.admitted} has {prompt.numel()} tokens, but max_length is {self.max_length}: "
                             "set max_new_tokens, or a larger max_length")
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or (self.vocab_size is not None and high >= self.vocab_size):
            bad = low if low < 0 else high
            raise ValueError(f"prompt {self.admitted} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        return prompt, budget

    def _unpadded_by_id(self, prompt: torch.Tensor) -> torch.Tensor:
        """A prompt given without a mask, less the pad ids before its tokens (plain generate() infers a mask
        from pad_token_id when it is not an EOS id) and after them (right padding, which plain generate()
        decodes past): the output is the unpadded prompt's."""
        kept = _strip(prompt, prompt != self.pad_token_id, self.admitted,
                      f" holds pad_token_id {self.pad_token_id} between its tokens, which plain generate() would mask "
                      "as padding: pass {'input_ids': ..., 'attention_mask': ...} to say which tokens are real")
        if not kept.numel():
            raise ValueError(f"prompt {self.admitted} holds only pad_token_id {self.pad_token_id}: no real token")
        return kept

    def take(self, count: int) -> list[torch.Tensor]:
        """Up to `count` prompts that are waiting now (fewer once the source yields None or ends).
        Items that cannot be served get their error result here and take no row."""
        taken = []
        while len(taken) < count and not self.exhausted:
            try:
                item = next(self._source)
            except StopIteration:
                self.exhausted = True
                break
            except Exception as error:  # the source failed: the stream stops, what runs finishes
                self._stop(error, "the prompt source")
                break
            if item is None and self.total is None:  # a live source: nothing waiting yet
                break
            try:
                if item is None:  # a list's item: it keeps its index, as its error
                    raise ValueError(f"prompt {self.admitted} is None: None means 'nothing waiting yet' only from an "
                                     "iterator; in a list every item is a prompt")
                prompt, budget = self._prompt(item)
            except ValueError as error:
                shown = _as_ids(item)  # its tokens on the prompt's device, as a served result's
                self._deliver(StreamResult(self.admitted, shown, torch.empty(0, dtype=torch.long, device=shown.device),
                                           AcceptanceStats(), error))
                self.admitted += 1
                continue
            if budget is not None:
                self.budgets[len(self.stream_index)] = budget
            self.stream_index.append(self.admitted)
            self.admitted += 1
            taken.append(prompt)
        return taken

    def first(self) -> torch.Tensor | None:
        """The first prompt, waiting for it if the source has none yet; None for an empty stream."""
        while not self.exhausted:
            got = self.take(1)
            if got:
                return got[0]
            if not self.exhausted:
                time.sleep(0.005)
        return None

    def wait(self) -> None:
        """The batch is empty and no prompt is waiting: pause briefly before asking again."""
        time.sleep(0.005)

    def max_new_tokens(self, row: int, prompt: torch.Tensor, generation_config: GenerationConfig) -> int:
        """Row `row`'s budget: its own, else the call's max_new_tokens, else what plain generate() gives
        this prompt alone (max_length minus its length; with no max_length set, transformers' default
        of 20 new tokens, capped by the model's positions)."""
        length, index = prompt.shape[0], self.stream_index[row]
        if row in self.budgets:
            budget = self.budgets[row]
        elif generation_config.max_new_tokens is not None:
            budget = generation_config.max_new_tokens
        elif self.default_length:
            limit = TRANSFORMERS_DEFAULT_MAX_LENGTH + length
            budget = max(1, (limit if self.max_positions is None else min(limit, self.max_positions)) - length)
        else:  # the call's max_length (the first call's config may hold a first prompt's own longer one)
            limit = self.max_length or generation_config.max_length
            budget = limit - length
            if budget < 1:  # plain generate() raises; this request fails alone (its one token is dropped)
                self.cut[row] = (0, ValueError(f"prompt {index} has {length} tokens, but max_length is "
                                               f"{limit}: set max_new_tokens, or a larger max_length"))
                return 1
        room = None if self.max_positions is None else self.max_positions - length + 1  # the last token is never fed
        if self.learned_positions and room is not None and budget > room:  # plain generate() fails there
            self.cut[row] = (room, ValueError(f"prompt {index}: its {length} tokens and {budget} new ones pass the "
                                              f"target's {self.max_positions} learned positions; it stopped at the last"))
            return room
        return budget

    def stopped_at_budget(self, row: int) -> None:
        """Row `row`'s stopping criteria ended it on its budget's last token: a cut at learned positions is
        no failure there (plain generate() stops before it would feed that token)."""
        if self.cut.get(row, (0, None))[0] > 0:
            del self.cut[row]

    def fail(self, row: int, error: BaseException) -> None:
        """Row `row` cannot go on (its stopping criteria raised): it finishes with this error."""
        self.failed[row] = error

    def finished(self, row: int, prompt: torch.Tensor, tokens: list[int], acceptance: AcceptanceStats) -> None:
        error, (limit, cut) = self.failed.pop(row, None), self.cut.pop(row, (len(tokens) + 1, None))
        if error is None and len(tokens) >= limit:  # it reached the cut in its budget
            error, tokens = cut, tokens[:limit]
        self._deliver(StreamResult(self.stream_index[row], prompt, to_device(tokens, prompt.device), acceptance, error,
                                   row=row))

    def _deliver(self, result: StreamResult) -> None:
        self.results[result.index] = result
        if self._bar is not None:
            self._bar.update(1)
        if self.on_result is not None:
            try:
                self.on_result(result)
            except Exception as error:  # the consumer failed: no more calls to it, the stream stops
                self.on_result = None
                self._stop(error, "on_result")

    def _stop(self, error: BaseException, who: str) -> None:
        if self.stopped is None:
            self.stopped, self.stopped_by = error, who
        self.exhausted = True

    def error(self, cause: BaseException | None = None) -> StreamError:
        """The StreamError for a stream that stopped (`cause`: the decode loop's own failure, if any)."""
        complete = [self.results[i] for i in sorted(self.results)]
        started = set(self.stream_index) | set(self.results)
        unfinished = sorted(i for i in started if i not in self.results)
        not_started = None if self.total is None else list(range(self.admitted, self.total))
        what = f"{self.stopped_by} raised {self.stopped!r}" if cause is None else f"the decode loop raised {cause!r}"
        message = (f"continuous batching stopped: {what}. {len(complete)} results complete (on this error's "
                   f".results); requests from index {self.admitted} on never started")
        if unfinished:
            message += f"; requests {unfinished} had started and did not finish"
        return StreamError(message, complete, self.admitted, not_started)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _setting(name: str, kwargs: dict, model: PreTrainedModel) -> Any:
    """A generation setting as generate() resolves it: the keyword (an explicit None too), else the config
    passed, else the model's."""
    if name in kwargs:
        return kwargs[name]
    given = kwargs.get("generation_config")
    for value in (getattr(given, name, None), getattr(model.generation_config, name, None)):
        if value is not None:
            return value
    return None


def _input_device(model: PreTrainedModel) -> torch.device | int | str:
    """Where prompts go: the model's device, or for weights that accelerate offloaded (`model.device` is meta)
    the device its hooks run the embedding on, as accelerate names it (0 for the first accelerator), the CPU
    where none is named."""
    if model.device.type != "meta":
        return model.device
    for module in (model.get_input_embeddings(), model):
        device = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if device is not None:
            return device
    return torch.device("cpu")


def learned_positions(model: PreTrainedModel) -> bool:
    """Whether the model looks positions up in a table of `context_length` rows (GPT-2's `wpe`; OPT's has
    2 more), so none exists past it: rotary models compute any position."""
    from .proposals.draft_model import context_length

    limit, inputs = context_length(model.config), model.get_input_embeddings()
    return limit is not None and any(isinstance(m, torch.nn.Embedding) and m is not inputs
                                     and m.num_embeddings in (limit, limit + 2) for m in model.modules())


def _unpadded(item: Mapping[str, Any], index: int) -> Any:
    """A mapping's prompt ids, less the padding its `attention_mask` marks (a tokenizer's output for
    one text of a padded batch): zeros only before or after the real tokens, never between them."""
    ids, mask = item["input_ids"], item.get("attention_mask")
    if mask is None:
        return ids
    try:
        ids, mask = (t[0] if t.dim() == 2 and t.shape[0] == 1 else t for t in map(torch.as_tensor, (ids, mask)))
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"prompt {index}: input_ids and attention_mask must be sequences of numbers: {error}") from None
    if ids.dim() != 1 or mask.shape != ids.shape:
        raise ValueError(f"prompt {index}: input_ids must be one sequence with an attention_mask of its shape, got "
                         f"{tuple(ids.shape)} and {tuple(mask.shape)}")
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"prompt {index}: attention_mask must hold 0 (padding) and 1 (a token) only")
    return _strip(ids, mask != 0, index, ": attention_mask has a hole between real tokens; only padding before or "
                  "after the prompt can be dropped")


def _strip(ids: torch.Tensor, real: torch.Tensor, index: int, hole: str) -> torch.Tensor:
    """`ids` less the padding before and after its real tokens (`real`, per token); padding between them is
    a ValueError, "prompt {index}{hole}"."""
    kept = real.nonzero()[:, 0].tolist()
    if kept and kept[-1] - kept[0] + 1 != len(kept):
        raise ValueError(f"prompt {index}{hole}")
    return ids[kept[0] : kept[-1] + 1] if kept else ids[:0]


def _as_ids(item: Any) -> torch.Tensor:
    """A failed item's prompt for its result: its ids if they read as a 1-D integer tensor, else empty."""
    try:
        ids = torch.as_tensor(item["input_ids"] if isinstance(item, Mapping) else item)
        if ids.dim() == 1 and not ids.is_floating_point():
            return ids.long()
    except Exception:
        pass
    return torch.empty(0, dtype=torch.long, device="cpu")


def _eos_ids(eos) -> set[int]:
    """The EOS ids as a set (None: none); anything but token ids named."""
    try:
        ids = [] if eos is None else torch.as_tensor(eos).flatten().tolist()
    except (TypeError, ValueError, RuntimeError):
        ids = [eos]
    if not all(isinstance(e, int) and not isinstance(e, bool) for e in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos!r}")
    return set(ids)


def _check_call(model, prompts, assistant, max_batch_size, on_result, progress, generate_kwargs) -> None:
    """`generate_continuous`'s arguments, before the first prompt is read (a streamer given is ended)."""
    from .arguments import _is_model, check_arguments, check_embeddings

    for name in ("streamer", "spec_streamer"):
        if generate_kwargs.get(name) is not None:
            if callable(getattr(generate_kwargs[name], "end", None)):
                generate_kwargs[name].end()  # a consumer iterating it must not wait
            raise ValueError("streamers take one row; continuous batching runs many (use on_result for each finished "
                             "prompt). The streamer has been ended.")
    if not _is_model(model):  # a compiled one too
        raise ValueError(f"generate_continuous takes a transformers model (the target), got {type(model).__name__}")
    check_embeddings(model)
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, numbers.Integral) or max_batch_size < 1:
        raise ValueError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
    if on_result is not None and not callable(on_result):
        raise ValueError(f"on_result must be callable, got {type(on_result).__name__}")
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True or False, got {progress!r}")
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be an iterable of token id sequences, got {type(prompts).__name__}")
    if isinstance(prompts, Mapping):  # a tokenizer's BatchEncoding: iterating it gives its keys
        raise ValueError(f"prompts is a mapping ({type(prompts).__name__}, a tokenizer's output?): pass one prompt per "
                         "item, e.g. [{'input_ids': i, 'attention_mask': m} for i, m in zip(enc['input_ids'], "
                         "enc['attention_mask'])]")
    if (isinstance(prompts, torch.Tensor) and prompts.dim() < 2) or (
            isinstance(prompts, Sequence) and len(prompts) and isinstance(prompts[0], numbers.Integral)):
        raise ValueError("prompts is one sequence of token ids: generate_continuous takes an iterable of prompts (a list "
                         "of id lists, or a 2-D tensor's rows); to pass one prompt, give [prompt]")
    if "attention_mask" in generate_kwargs:
        raise ValueError("generate_continuous takes no attention_mask argument: give a padded prompt's mask in its "
                         "mapping, {'input_ids': ..., 'attention_mask': ...}, and its padding is dropped")
    for name in ("input_ids", "inputs"):  # transformers' own error would name the first prompt
        if name in generate_kwargs:
            raise ValueError(f"generate_continuous takes no {name} argument: its prompts are the second argument, "
                             "generate_continuous(model, prompts, ...)")
    check_arguments(dict(generate_kwargs, assistant=assistant))
    for name in ("return_dict_in_generate", "output_scores", "output_logits"):
        if _setting(name, generate_kwargs, model):
            raise ValueError(f"generate_continuous returns one StreamResult a prompt (its tokens, acceptance and error): "
                             f"{name} has no place in it (one generate call per prompt returns scores)")
    deadline = generate_kwargs["max_time"] if "max_time" in generate_kwargs else _setting("max_time", generate_kwargs, model)
    if deadline is not None:  # max_time=None drops one the configs set, as in generate()
        source = "" if "max_time" in generate_kwargs else " (set in a generation config; max_time=None drops it)"
        raise ValueError(f"max_time{source} is one generate() call's deadline; a stream admits prompts over time, and "
                         "every prompt admitted after it passed would be cut at its first token. Bound each prompt with "
                         "max_new_tokens (or a budget in its mapping), or stop feeding prompts from your iterator")
    if (_setting("num_return_sequences", generate_kwargs, model) or 1) != 1:
        raise ValueError("generate_continuous returns one StreamResult a prompt: for n samples of a prompt, give it n "
                         "times in prompts (rows of one stream retrieve from each other's text)")
    for name in ("max_new_tokens", "max_length"):  # plain generate() takes 2.5 and rounds; the loop needs integers
        value = _setting(name, generate_kwargs, model)  # a keyword, the config passed, or the model's
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def generate_continuous(
    model: PreTrainedModel,
    prompts: Iterable[PromptItem],
    *,
    assistant: PreTrainedModel | None = None,
    max_batch_size: int = 8,
    on_result: Callable[[StreamResult], None] | None = None,
    progress: bool = False,
    **generate_kwargs: Any,
) -> list[StreamResult]:
    """Speculative decoding of a stream of prompts with continuous batching (see the module doc).

    `generate_kwargs` are `generate()`'s and `speculative_generate`'s (`max_new_tokens`, `do_sample`,
    `temperature`, `generator`, `acceptance_sink`, `costs`, ...). Returns one `StreamResult` per
    prompt in the order given (a failed one with its `error`); `on_result` receives each as soon as
    its row finishes. Raises `StreamError` (with the complete results) if the stream stopped early."""
    from .arguments import stop_strings_as_criteria
    from .generate import speculative_generate
    from .proposals.draft_model import context_length

    _check_call(model, prompts, assistant, max_batch_size, on_result, progress, generate_kwargs)
    generate_kwargs = stop_strings_as_criteria(model, dict(generate_kwargs), "generate_continuous()")
    max_length, max_new_tokens, pad, eos = (_setting(name, generate_kwargs, model) for name in (
        "max_length", "max_new_tokens", "pad_token_id", "eos_token_id"))
    eos = _eos_ids(eos)
    requests = Requests(prompts, int(max_batch_size), _input_device(model), on_result, progress,
                        vocab_size=model.get_input_embeddings().weight.shape[0],
                        default_length=max_length is None and max_new_tokens is None,
                        max_positions=context_length(model.config), learned_positions=learned_positions(model),
                        max_length=max_length if max_new_tokens is None else None,
                        pad_token_id=pad if isinstance(pad, int) and pad not in eos else None)
    try:
        first = requests.first()
        if first is not None:
            # a first prompt past max_length with a budget of its own: transformers' own check would refuse it (later
            # prompts' budgets read requests.max_length, the call's)
            own, limit = requests.budgets.get(0), requests.max_length
            longer = {} if own is None or limit is None or first.numel() < limit else dict(max_length=first.numel() + own)
            model.generate(
                first[None], attention_mask=torch.ones_like(first[None]), custom_generate=speculative_generate,
                assistant=assistant, requests=requests, **{**generate_kwargs, **longer},
            )
    except Exception as error:
        if not requests.decoding:
            raise  # the call's own error (bad arguments, an unsupported model), as it is: no prompt was decoded
        raise requests.error(error) from error
    finally:
        requests.close()
    if requests.stopped is not None:
        raise requests.error() from requests.stopped
    return [requests.results[i] for i in range(requests.admitted)]

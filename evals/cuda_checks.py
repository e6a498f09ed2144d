"""Checks that need the accelerator itself, on tiny models built from configs (no downloads):

1. device-to-host synchronisations per round, counted by CUDA (`torch.cuda.set_sync_debug_mode`: every
   synchronising call warns, and the warnings are counted) for hf_specdec's chains (greedy and
   sampling), trees (greedy), a batch of 4 rows (both modes), beside plain decoding per token and
   transformers' assisted generation per round; on a CPU (the dry run) host reads of tensor values
   instead (`count_host_reads`), the same calls that synchronise on an accelerator;
2. greedy identity against plain greedy on the same device, on three architectures (float32, where
   there are no rounding ties), with the default levers and with a fixed draft length;
3. one chi-square of sampled sequences against the exact law (enumerated from the target on the
   device), and the same test on a broken variant (q reported unprocessed) that it must reject.

    python evals/cuda_checks.py --device cuda --out runs/gpu/checks     # on the device machine
    python evals/cuda_checks.py --dry-run --out runs/gpu-dry/checks     # on a CPU: small, no sync counts

Writes checks.json and checks.md under --out and exits non-zero if identity or a chi-square fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

import hf_specdec  # noqa: E402
sys.path.insert(0, str(HERE))
from common import REQUIRED, add_options  # noqa: E402
from conftest import ARCHITECTURES, chi_square_against, perturbed, tiny_model  # noqa: E402
from test_exactness import NEW, SAMPLING, VOCAB, UnprocessedQ, exact_joint, processors  # noqa: E402

ALPHA = 1e-3
PINNED = dict(costs=hf_specdec.Costs(draft_step=0.3, verify=0.02))  # the planner on, reading no clock
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy")


def count_host_reads(call) -> tuple[object, int]:
    """(call's result, how many times it read a tensor's value on the host: Tensor.item, tolist,
    bool(), int(), float(), cpu(), numpy()). On the CPU a proxy for what would be a device-to-host
    copy on an accelerator (each is a synchronisation there)."""
    originals, count = {name: getattr(torch.Tensor, name) for name in HOST_READS}, [0]

    def counting(original):
        def wrapper(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)
        return wrapper

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counting(original))
        result = call()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return result, count[0]


def count_syncs(call, sites: Counter | None = None) -> tuple[object, int | None]:
    """(call's result, synchronising CUDA calls it made; off CUDA, host reads: `count_host_reads`).
    With `sites`, each synchronisation is also counted there under the innermost line of hf_specdec
    (else of transformers, else the caller) that made it."""
    if not torch.cuda.is_available():
        return count_host_reads(call)
    torch.cuda.synchronize()
    count = [0]

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        count[0] += 1
        if sites is not None:
            sites[_site(traceback.extract_stack()[:-1])] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, count[0]


def _site(stack) -> str:
    """The innermost frame of hf_specdec (else of transformers, else the caller's) that made a
    synchronisation, and the innermost frame below it in transformers where there is one."""
    frames = [f for f in stack if not f.filename.endswith("warnings.py") and "cuda_checks" not in f.filename]
    def short(frame, marker):
        name = frame.filename.split(marker)[-1]
        return f"{marker.strip('/')}/{name}:{frame.lineno} {frame.name}: {(frame.line or '').strip()[:60]}"
    for marker in ("/hf_specdec/", "/transformers/"):
        hits = [i for i, f in enumerate(frames) if marker in f.filename]
        if hits:
            site = short(frames[hits[-1]], marker)
            below = [f for f in frames[hits[-1] + 1:] if "/transformers/" in f.filename]
            return site + (f" > {short(below[-1], '/transformers/')}" if below and marker != "/transformers/" else "")
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def sync_table(device: str, new_tokens: int) -> list[dict]:
    target = tiny_model("qwen2", vocab=256, seed=3)
    draft = perturbed(target, noise=0.05).to(device)  # close to the target: most rounds draft
    target = target.to(device)
    gen = torch.Generator().manual_seed(0)
    one = torch.randint(2, 256, (1, 24), generator=gen).to(device)
    one = torch.cat([one, one[:, :12]], dim=1)  # a repeat, so lookups and trees have something to find
    four = torch.randint(2, 256, (4, 24), generator=gen).to(device)
    spec = dict(custom_generate=hf_specdec.speculative_generate, assistant=draft, return_dict_in_generate=True)
    greedy, sampling = dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_p=0.95)
    cases = [
        ("hf_specdec chain, greedy", one, dict(spec, tree=False, **greedy, **PINNED)),
        ("hf_specdec chain, sampling", one, dict(spec, **sampling, **PINNED)),
        ("hf_specdec chain, fixed k=5, greedy", one, dict(spec, adaptive=False, ngram=False, num_draft_tokens=5, **greedy)),
        ("hf_specdec tree, greedy", one, dict(spec, tree=True, **greedy, **PINNED)),
        ("hf_specdec batch of 4, greedy", four, dict(spec, **greedy, **PINNED)),
        ("hf_specdec batch of 4, sampling", four, dict(spec, **sampling, **PINNED)),
        ("transformers assisted, greedy", one, dict(assistant_model=draft, return_dict_in_generate=True, **greedy)),
        ("plain, greedy", one, dict(return_dict_in_generate=True, **greedy)),
    ]
    rows = []
    for name, ids, kwargs in cases:
        def call(tokens=new_tokens, ids=ids, kwargs=kwargs):
            return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, **kwargs)

        count_syncs(lambda: call(4))  # warm-up
        forwards = []
        hook = target.register_forward_hook(lambda *args: forwards.append(1))
        sites = Counter()
        try:
            out, syncs = count_syncs(call, sites)
        finally:
            hook.remove()
        rounds = len(forwards)  # target forwards: a round each (a step for plain decoding), the prefill's included
        rows.append(dict(case=name, syncs=syncs, rounds=rounds, tokens=out.sequences.shape[1] - ids.shape[1],
                         per_round=None if syncs is None else round(syncs / max(1, rounds), 2),
                         sites=sites.most_common(12)))
        print(rows[-1])
    return rows


def greedy_identity(device: str, new_tokens: int) -> list[dict]:
    rows = []
    for arch in ARCHITECTURES:
        target = tiny_model(arch, seed=11)
        draft = perturbed(target, noise=0.5).to(device)
        target = target.to(device)
        for levers in ({}, PINNED, dict(adaptive=False, ngram=False, num_draft_tokens=4)):
            gen = torch.Generator().manual_seed(len(rows))
            ids = torch.randint(2, 64, (3, 10), generator=gen).to(device)
            ids[:, 6:] = ids[:, :4]  # repeats, so lookups and trees are taken
            same = 0
            for row in ids:
                prompt = row[None]
                plain = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
                spec = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False,
                                       custom_generate=hf_specdec.speculative_generate, assistant=draft, **levers)
                same += torch.equal(plain, spec)
            batch = target.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                    custom_generate=hf_specdec.speculative_generate, assistant=draft, **levers)
            plain_batch = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            rows.append(dict(arch=arch, levers=json.dumps(levers, default=repr), rows_equal=f"{same}/{len(ids)}",
                             batch_equal=bool(torch.equal(batch, plain_batch)),
                             ok=same == len(ids) and bool(torch.equal(batch, plain_batch))))
            print(rows[-1])
    return rows


def chi_square(device: str, samples: int, batch: int) -> list[dict]:
    """Sampled sequences as rows of batched calls (rows are independent draws of the same law)."""
    target = tiny_model("llama", vocab=VOCAB, seed=21, init=0.25)
    draft = perturbed(target, noise=0.4).to(device)
    target = target.to(device)
    prompt = torch.tensor([[1, 5, 2]], device=device)
    law = exact_joint(target, prompt)
    rows = []
    variants = [("hf_specdec, fixed k=2", dict(assistant=draft, adaptive=False, ngram=False, num_draft_tokens=2)),
                ("hf_specdec, cost model", dict(assistant=draft, **PINNED)),
                ("broken: q reported unprocessed", dict(candidate_generator=UnprocessedQ(draft, processors(), do_sample=True),
                                                        adaptive=False, ngram=False, num_draft_tokens=2))]
    for seed, (name, kwargs) in enumerate(variants):
        torch.manual_seed(seed)
        drawn = []
        while len(drawn) < samples:
            rows_now = min(batch, samples - len(drawn))
            out = target.generate(prompt.repeat(rows_now, 1), max_new_tokens=NEW, **SAMPLING,
                                  custom_generate=hf_specdec.speculative_generate, **kwargs)
            drawn += [tuple(r) for r in out[:, prompt.shape[1]:].tolist()]
        statistic, dof, pvalue = chi_square_against(law, drawn)
        broken = name.startswith("broken")
        rows.append(dict(variant=name, samples=len(drawn), chi2=round(statistic, 1), dof=dof, p=pvalue,
                         ok=(pvalue < ALPHA) if broken else (pvalue > ALPHA)))
        print(rows[-1])
    return rows


def markdown(result: dict) -> str:
    what = "synchronisations (CUDA's count)" if "dry run" not in result["device"] else "host reads of tensor values (CPU proxy)"
    lines = [f"# CUDA checks ({result['device']})", "", f"## {what} per round (a round: one target forward)", "",
             "| case | count | target forwards | tokens | per round |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['syncs']} | {r['rounds']} | {r['tokens']} | {r['per_round']} |" for r in result["syncs"]]
    for r in result["syncs"]:
        if r.get("sites"):
            lines += ["", f"Where {r['case']} synchronises (count, innermost hf_specdec line, else transformers):", ""]
            lines += [f"- {n}: `{site}`" for site, n in r["sites"]]
    if not result.get("identity"):
        return "\n".join(lines) + "\n"
    lines += ["", "## Greedy identity (float32)", "", "| arch | levers | rows equal | batch equal |", "|---|---|---|---|"]
    lines += [f"| {r['arch']} | `{r['levers']}` | {r['rows_equal']} | {r['batch_equal']} |" for r in result["identity"]]
    lines += ["", f"## Chi-square (alpha {ALPHA})", "", "| variant | samples | chi2 | dof | p | as expected |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['samples']} | {r['chi2']} | {r['dof']} | {r['p']:.2e} | {r['ok']} |"
              for r in result["chi_square"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    add_options(parser, out=REQUIRED)
    parser.add_argument("--dry-run", action="store_true", help="CPU, few tokens and samples: checks the script runs")
    parser.add_argument("--syncs-only", action="store_true", help="only the synchronisation table (with sites)")
    args = parser.parse_args(argv)
    device, new_tokens, samples, batch = args.device, 48, 6000, 1000
    if args.dry_run:
        device, new_tokens, samples, batch = "cpu", 8, 200, 100
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("cuda_checks.py: torch sees no CUDA device (use --dry-run on a CPU)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(device=torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu (dry run)",
                  torch=torch.__version__)
    result["syncs"] = sync_table(device, new_tokens)
    result["identity"], result["chi_square"] = [], []
    if not args.syncs_only:
        result["identity"] = greedy_identity(device, new_tokens)
        result["chi_square"] = chi_square(device, samples, batch)
    (out / "checks.json").write_text(json.dumps(result, indent=1))
    (out / "checks.md").write_text(markdown(result))
    print(markdown(result))
    failed = [r for r in result["identity"] + result["chi_square"] if not r["ok"]]
    if failed and not args.dry_run:
        print(f"FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

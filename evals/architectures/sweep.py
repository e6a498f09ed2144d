"""Every causal-LM and image-text-to-text class of transformers, built tiny, checked against plain generate().

Entries: every (model type, class) of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and
MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES. Each class's default config is shrunk (2 layers, width 64,
vocabulary 256, random weights at initializer_range 0.3 so that greedy choices are rarely near-ties;
OVERRIDES below for the configs the shrinking alone leaves inconsistent) and run text-only, eos off.

Roles (--role):
  target      the class is the target: one row and a left-padded batch of 2, with a 1-layer Llama draft and
              with a perturbed copy of itself (default settings, tree=False, k=4 fixed); classes with a
              sliding window are rebuilt with a window of 8 tokens and checked past it.
  draft       the class is the draft of a tiny Llama target: k=4, default, a batch of 2, sampling runs;
              again with both heads biased toward one token so that some drafts are accepted; window 8.
  continuous  hf_specdec.generate_continuous on 6 prompts, batch 2 and 3, uniform budgets, per-prompt
              budgets and an eos; each prompt's tokens against plain generate() of that prompt alone.

Outcome per class (the worst of its checks): equal (greedy equal to plain; sampling runs ok) / differs
(first differing new-token position and plain's top-two logit margin there) / refused (hf_specdec raised
a ValueError naming what it does not support) / crash (anything else) / plain fails (plain generate()
with the model fails too: nothing to compare) / skipped (the config cannot be built tiny) / timeout.

    python evals/architectures/sweep.py --role target --out runs/sweep-target            # every class, ~40 min
    python evals/architectures/sweep.py --role draft --only llama gpt2 --out runs/sw     # two model types

Each class runs in its own subprocess (--timeout seconds), so a crash or hang does not stop the sweep;
DIR/results.jsonl gets one line a class and DIR/table.md the table.
"""
import argparse, collections, copy, json, os, subprocess, sys, time, traceback

NEW = 24
SET = {  # config keys shrunk wherever they occur (sub-configs included)
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "hidden_dim", "n_embed"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "intermediate_size_mlp",
                     "encoder_ffn_dim", "decoder_ffn_dim", "d_ff"), 128),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 64),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                     "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "attention_heads", "n_heads",
                     "decoder_attention_heads", "encoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    "num_experts_per_tok": 2, "moe_topk": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "head_dim": 16, "kv_channels": 16, "vocab_size": 256, "max_position_embeddings": 2048, "n_positions": 2048,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "image_size": 32, "patch_size": 8, "num_channels": 3,
}
WINDOW_KEYS = ("sliding_window", "attention_chunk_size", "window_size", "local_window_size")
_MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}  # sums to head_dim 16 / 2
OVERRIDES = {  # where shrinking leaves a config inconsistent (rotary sections, head sizes, layer patterns)
    **{t: {"text_config": {"rope_parameters": _MROPE}}
       for t in ("qwen2_vl", "qwen2_5_vl", "glm4v", "glm46v", "glm_ocr", "paddleocr_vl", "glmga")},
    "glm4v_moe": {"text_config": {"rope_parameters": dict(_MROPE, mrope_section=[1, 1, 2], partial_rotary_factor=0.5)}},
    "codegen": {"rotary_dim": 8}, "gptj": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 256},
    "deepseek_v2": {"head_dim": 8}, "deepseek_v3": {"head_dim": 8}, "longcat_flash": {"head_dim": 8},
    "youtu": {"head_dim": 8}, "axk1": {"head_dim": 8}, "kimi_k25": {"text_config": {"head_dim": 8}},
    **{t: {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
       for t in ("ministral", "hunyuan_v1_dense", "hunyuan_v1_moe")},
}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORDER = ["equal", "refused", "differs", "crash"]  # a class's outcome is its worst check's


def entries(only=()):
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CM,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IM)
    out = {}
    for mapping in (CM, IM):
        for mtype, cls in mapping.items():
            cls = cls[0] if isinstance(cls, (tuple, list)) else cls
            if not only or mtype in only:
                out.setdefault(f"{mtype} / {cls}", (mtype, cls))
    return out


# ---- tiny models -------------------------------------------------------------------------------------

def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def shrink(d, window):
    """The overrides that make config dict `d` tiny, recursing into sub-configs."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and (k.endswith("_config") or "model_type" in v):
            out[k] = shrink(v, window)
        elif k in SET and _is_int(v):
            out[k] = SET[k]
        elif k in WINDOW_KEYS and _is_int(v) and v > 0:
            out[k] = window
        elif k in ("layer_types", "layers_block_type", "block_types") and v and all(isinstance(x, str) for x in v):
            kinds = list(dict.fromkeys(v))[:2]  # keep each kind of layer the model mixes, up to two layers
            out[k] = kinds + kinds[-1:] * (2 - len(kinds))
        elif k == "initializer_range":
            out[k] = 0.3
    if "num_key_value_heads" in d and (d["num_key_value_heads"] is None or "kv_lora_rank" in d):
        out["num_key_value_heads"] = 4 if "kv_lora_rank" in d else 2
    for k, new in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2)):
        if _is_int(d.get(k)) and d[k] >= 256:
            out[k] = new
    return out


def deep_update(d, u):
    for k, v in u.items():
        d[k] = deep_update(d[k], v) if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return d


def build(mtype, cls_name, window=4096, seed=0):
    import torch, transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    cfg_cls = CONFIG_MAPPING[mtype]
    kw = deep_update(shrink(cfg_cls().to_dict(), window), copy.deepcopy(OVERRIDES.get(mtype, {})))
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg_cls(**kw)).eval()
    model.generation_config.eos_token_id = None  # every run makes its NEW tokens
    model.generation_config.pad_token_id = 0
    return model


def has_window(d, depth=0):
    return depth <= 3 and any((k in WINDOW_KEYS and _is_int(v) and v > 0) or (isinstance(v, dict) and has_window(v, depth + 1))
                              for k, v in d.items())


def special_ids(d, depth=0):
    """Token ids a config names (image tokens, pad, bos...): prompts avoid them."""
    ids = set()
    for k, v in d.items():
        k = str(k)
        if isinstance(v, dict) and depth < 3:
            ids |= special_ids(v, depth + 1)
        elif ("token" in k or "index" in k or k.endswith("_id")) and _is_int(v):
            ids.add(v)
        elif "token" in k and isinstance(v, list):
            ids.update(x for x in v if _is_int(x))
    return ids


def vocab(model):
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size


def allowed_ids(model):
    import torch
    bad = special_ids(model.config.to_dict()) | {0, 1, 2}
    return torch.tensor([i for i in range(3, min(vocab(model), 256)) if i not in bad])


def tiny_llama(V, layers=1, hidden=32, seed=5):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                     max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=None)).eval()
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = None, 0
    return m


def perturbed(model, scale=0.01):
    """A copy with 1% noise on every weight: a draft that agrees with the target most of the time."""
    import torch
    twin, g = copy.deepcopy(model), torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in twin.parameters():
            if p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return twin


def biased(model, token, strength=3.2):
    """Standardise the head's logits and raise `token`'s: two unrelated random models then agree often."""
    def hook(mod, inp, out):
        o = out.float()
        o = (o - o.mean(-1, keepdim=True)) / o.std(-1, keepdim=True).clamp_min(1e-6)
        o[..., token] += strength
        return o.to(out.dtype)
    model.get_output_embeddings().register_forward_hook(hook)
    return model


def inputs(allowed, seed=11):
    """One row of 10 tokens, and a batch of 2 whose second row is left-padded by 4."""
    import torch
    g = torch.Generator().manual_seed(seed)
    one = allowed[torch.randint(len(allowed), (1, 10), generator=g)]
    two = allowed[torch.randint(len(allowed), (2, 10), generator=g)]
    mask = torch.ones_like(two)
    two[1, :4], mask[1, :4] = 0, 0
    return one, (two, mask)


# ---- checks ------------------------------------------------------------------------------------------

class PlainFails(Exception):
    pass


def where(e):
    tb = traceback.extract_tb(e.__traceback__)
    file = tb[-1].filename.split("site-packages/")[-1].replace(ROOT + os.sep, "") if tb else ""
    last = f" (at {file}:{tb[-1].lineno})" if tb else ""
    return f"{type(e).__name__}: {str(e)[:400]}{last}"


def failure(e):
    """A refusal is a ValueError hf_specdec raises itself; anything else is a crash."""
    tb = traceback.extract_tb(e.__traceback__)
    refused = isinstance(e, ValueError) and (not tb or "hf_specdec" in tb[-1].filename)
    return dict(status="refused" if refused else "crash", detail=where(e))


_PLAIN = {}


def plain(target, ids, mask=None):
    key = (id(target), ids.numpy().tobytes(), None if mask is None else mask.numpy().tobytes())
    if key not in _PLAIN:
        try:
            _PLAIN[key] = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                                          return_dict_in_generate=True, output_logits=True)
        except Exception as e:
            raise PlainFails(where(e)) from e
    return _PLAIN[key]


def first_diff(ref, got, logits, P):
    """Row, new-token position and plain's top-two logit margin there, of the first difference."""
    for r in range(ref.shape[0]):
        n = min(ref.shape[1], got.shape[1])
        d = (ref[r, :n] != got[r, :n]).nonzero()
        if len(d) or ref.shape[1] != got.shape[1]:
            k = int(d[0]) if len(d) else n
            top = logits[k - P][r].float().topk(2).values if 0 <= k - P < len(logits) else None
            return dict(row=r, pos=k - P, margin=None if top is None else round(float(top[0] - top[1]), 4))


def greedy(target, draft, ids, mask=None, **kw):
    import hf_specdec
    ref = plain(target, ids, mask)
    try:
        out = target.generate(ids, attention_mask=mask, custom_generate=hf_specdec.speculative_generate, assistant=draft,
                              do_sample=False, max_new_tokens=NEW, return_dict_in_generate=True, **kw)
    except Exception as e:
        return failure(e)
    if out.sequences.shape == ref.sequences.shape and bool((out.sequences == ref.sequences).all()):
        return dict(status="equal")
    return dict(status="differs", **first_diff(ref.sequences, out.sequences, ref.logits, ids.shape[1]))


def sampled(target, draft, ids, **kw):
    import hf_specdec, torch
    torch.manual_seed(0)
    try:
        seq = target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft,
                              do_sample=True, max_new_tokens=NEW, **kw)
    except Exception as e:
        return failure(e)
    ok = seq.shape == (ids.shape[0], ids.shape[1] + NEW) and 0 <= int(seq.min()) and int(seq.max()) < vocab(target)
    return dict(status="equal") if ok else dict(status="crash", detail=f"sampled shape {list(seq.shape)} or ids out of range")


def role_target(mtype, cls):
    target = build(mtype, cls)
    one, (two, mask) = inputs(allowed_ids(target))
    llama, twin = tiny_llama(vocab(target)), perturbed(target)
    plain(target, one)
    C = {"single llama": greedy(target, llama, one), "single llama tree=False": greedy(target, llama, one, tree=False),
         "single twin k4": greedy(target, twin, one, num_draft_tokens=4, adaptive=False),
         "single twin default": greedy(target, twin, one), "single twin tree=False": greedy(target, twin, one, tree=False),
         "batch2 llama": greedy(target, llama, two, mask),
         "batch2 twin k4": greedy(target, twin, two, mask, num_draft_tokens=4, adaptive=False),
         "batch2 twin default": greedy(target, twin, two, mask)}
    if has_window(target.config.to_dict()):
        t8 = build(mtype, cls, window=8)
        tw8 = perturbed(t8)
        C.update({"win8 single llama": greedy(t8, llama, one),
                  "win8 single twin k4": greedy(t8, tw8, one, num_draft_tokens=4, adaptive=False),
                  "win8 single twin default": greedy(t8, tw8, one),
                  "win8 batch2 twin k4": greedy(t8, tw8, two, mask, num_draft_tokens=4, adaptive=False)})
    return C


def draft_checks(target, draft, one, two, mask, prefix="", sample=True):
    C = {f"{prefix}k4": greedy(target, draft, one, num_draft_tokens=4, adaptive=False),
         f"{prefix}default": greedy(target, draft, one),
         f"{prefix}batch2 k4": greedy(target, draft, two, mask, num_draft_tokens=4, adaptive=False)}
    if sample:
        C[f"{prefix}batch2"] = greedy(target, draft, two, mask)
        C[f"{prefix}sample"] = sampled(target, draft, one)
    return C


def role_draft(mtype, cls):
    draft = build(mtype, cls)
    allowed = allowed_ids(draft)
    one, (two, mask) = inputs(allowed)
    try:  # can the class decode text-only with a cache at all?
        draft.generate(one, do_sample=False, max_new_tokens=3)
    except Exception as e:
        raise PlainFails("the draft alone: " + where(e)) from e
    target = tiny_llama(vocab(draft), layers=2, hidden=64, seed=1234)
    X = int(allowed[5])
    tb, db = biased(copy.deepcopy(target), X), biased(copy.deepcopy(draft), X)
    C = {**draft_checks(target, draft, one, two, mask), **draft_checks(tb, db, one, two, mask, "B ")}
    if has_window(draft.config.to_dict()):
        d8 = build(mtype, cls, window=8)
        C.update(draft_checks(target, d8, one, two, mask, "win8 ", sample=False))
        C.update(draft_checks(tb, biased(d8, X), one, two, mask, "win8 B ", sample=False))
    return C


LENS, BUDGETS = [3, 14, 7, 11, 5, 9], [16, 5, 11, 1, 8, 13]


def role_continuous(mtype, cls):
    import hf_specdec, torch
    target = build(mtype, cls)
    allowed = allowed_ids(target)
    g = torch.Generator().manual_seed(11)
    prompts = [allowed[torch.randint(len(allowed), (n,), generator=g)][None] for n in LENS]
    refs = [plain(target, p) for p in prompts]
    toks = [r.sequences[0, p.shape[1]:].tolist() for r, p in zip(refs, prompts)]
    seen = collections.Counter(t for row in toks for t in row[1:])  # an eos most rows meet, at different places
    eos = max(seen, key=lambda t: (sum(t in row for row in toks) >= 2, len({row.index(t) for row in toks if t in row})))
    C = {}
    for dname, draft in (("twin", perturbed(target)), ("llama", tiny_llama(vocab(target)))):
        for sname, extra in (("default", {}), ("k4", dict(num_draft_tokens=4, adaptive=False))):
            for variant in ("uniform", "budgets", "eos"):
                for B in (2, 3):
                    C[f"{dname} {sname} {variant} B{B}"] = stream(target, draft, prompts, toks, refs, B, variant, eos, extra)
    return C


def stream(target, draft, prompts, toks, refs, B, variant, eos, extra):
    import hf_specdec
    items, want = [p[0].tolist() for p in prompts], [list(t) for t in toks]
    kw = dict(assistant=draft, max_batch_size=B, max_new_tokens=NEW, do_sample=False, **extra)
    if variant == "budgets":
        items = [dict(input_ids=p, max_new_tokens=b) for p, b in zip(items, BUDGETS)]
        want = [t[:b] for t, b in zip(want, BUDGETS)]
    if variant == "eos":
        kw["eos_token_id"] = eos
        want = [t[:t.index(eos) + 1] if eos in t else t for t in want]
    try:
        results = hf_specdec.generate_continuous(target, items, **kw)
    except Exception as e:
        return failure(e)
    for i, r in enumerate(results):
        if not r.ok:
            return dict(failure(r.error), detail=f"prompt {i}: " + failure(r.error)["detail"])
        got = r.tokens.tolist()
        if got != want[i]:
            k = next((j for j in range(min(len(got), len(want[i]))) if got[j] != want[i][j]), min(len(got), len(want[i])))
            top = refs[i].logits[k][0].float().topk(2).values if k < len(refs[i].logits) else None
            return dict(status="differs", row=i, pos=k, margin=None if top is None else round(float(top[0] - top[1]), 4))
    return dict(status="equal")


# ---- one class in a child process; the sweep in the parent -------------------------------------------

def verdict(checks):
    counts = collections.Counter(c["status"] for c in checks.values())
    outcome = max(counts, key=ORDER.index)
    name, worst = next((n, c) for n, c in checks.items() if c["status"] == outcome)
    if outcome == "differs":
        note = f"{name}: row {worst['row']}, new token {worst['pos']}, plain's top-two margin {worst['margin']}"
    else:
        note = f"{name}: {worst['detail']}" if "detail" in worst else ""
    return outcome, dict(sorted(counts.items())), note


def run_one(role, mtype, cls):
    import transformers
    transformers.logging.set_verbosity_error()
    rec = dict(model_type=mtype, cls=cls, role=role)
    try:
        build(mtype, cls)
    except Exception as e:
        return dict(rec, outcome="skipped", note="config not built tiny: " + where(e))
    try:
        checks = {"target": role_target, "draft": role_draft, "continuous": role_continuous}[role](mtype, cls)
    except PlainFails as e:
        return dict(rec, outcome="plain fails", note=str(e))
    outcome, counts, note = verdict(checks)
    return dict(rec, outcome=outcome, counts=counts, note=note, checks=checks)


def run_child(args, key, mtype, cls):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", args.role, "--threads", str(args.threads), "--child", mtype, cls]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(key=key, model_type=mtype, cls=cls, role=args.role, outcome="timeout", note=f"over {args.timeout} s")
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    rec = json.loads(lines[-1]) if lines else dict(model_type=mtype, cls=cls, role=args.role, outcome="crash",
                                                    note=f"process exit {p.returncode}: {p.stderr[-300:]}")
    return dict(key=key, **rec, seconds=round(time.time() - t0, 1))


def table(records):
    rows = ["| type / class | outcome | checks | note |", "|---|---|---|---|"]
    for r in records:
        counts = ", ".join(f"{k} {v}" for k, v in r.get("counts", {}).items())
        note = r.get("note", "").replace("|", "/").replace("\n", " ")[:220]
        rows.append(f"| {r['key']} | {r['outcome']} | {counts} | {note} |")
    totals = collections.Counter(r["outcome"] for r in records)
    return "\n".join(rows) + "\n\n" + ", ".join(f"{k}: {v}" for k, v in totals.most_common()) + f" ({len(records)} classes)\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=("target", "draft", "continuous"), required=True)
    ap.add_argument("--only", nargs="+", default=(), metavar="TYPE", help="model types (default: every entry)")
    ap.add_argument("--out", help="folder for results.jsonl and table.md")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a class")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", nargs=2, metavar=("TYPE", "CLASS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import torch
        torch.set_num_threads(args.threads)
        print(json.dumps(run_one(args.role, *args.child), default=str), flush=True)
        return
    if not args.out:
        ap.error("--out is required")
    os.makedirs(args.out, exist_ok=True)
    todo = entries(set(args.only))
    records = []
    with open(os.path.join(args.out, "results.jsonl"), "w") as f:
        for key, (mtype, cls) in sorted(todo.items()):
            rec = run_child(args, key, mtype, cls)
            records.append(rec)
            f.write(json.dumps(rec, default=str) + "\n")
            f.flush()
            print(f"{key}: {rec['outcome']} {rec.get('note', '')[:150]}", flush=True)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table(records))


if __name__ == "__main__":
    main()

"""Greedy identity, refusals and sampling smoke checks of hf_specdec on one architecture built tiny from
its config (random weights; `archs.py` lists 54 configurations of 49 architectures).

    python evals/architectures/probe.py ARCH [OUT]       # prints one line a check, writes OUT/res_ARCH.json
    bash evals/architectures/runall.sh OUT ARCH ...      # every ARCH, printing only what is not equal, ok or refused for a window

Checks: one row, prompts of 5 and 70 tokens, default settings, tree=False, fixed k = 3; a copy and a
1-layer draft; a left-padded batch of 3 rows; sampling does not crash. Sliding windows are 16 tokens,
so 70-token prompts slide them; a batch that could outgrow the window is refused, and is rerun with a
512-token window.
"""
import sys, os, json, traceback, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch
torch.set_num_threads(1)
import hf_specdec
from archs import build, perturbed, V

arch = sys.argv[1]
OUT = sys.argv[2] if len(sys.argv) > 2 else "."
os.makedirs(OUT, exist_ok=True)
results = []
def rec(check, status, detail=""):
    results.append(dict(arch=arch, check=check, status=status, detail=detail))
    print(f"[{arch}] {check}: {status} {detail}", flush=True)

def lib_frame(e):
    tb = traceback.extract_tb(e.__traceback__)
    lib = [f for f in tb if "hf_specdec" in f.filename]
    last = tb[-1]
    lf = lib[-1] if lib else None
    s = f"{type(e).__name__}: {str(e)[:300]}"
    if lf: s += f" | last lib frame {os.path.basename(lf.filename)}:{lf.lineno} {lf.name}"
    s += f" | raised at {last.filename.split('site-packages/')[-1]}:{last.lineno} {last.name}"
    return s

def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, V, (1, n), generator=g)

def compare(check, target, draft, ids, mask=None, **kw):
    gen_kw = dict(do_sample=False, max_new_tokens=40)
    if mask is not None: gen_kw["attention_mask"] = mask
    try:
        plain = target.generate(ids, return_dict_in_generate=True, output_logits=True, **gen_kw)
    except Exception as e:
        rec(check, "PLAIN-CRASH", lib_frame(e)); return
    try:
        out = target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft,
                              return_dict_in_generate=True, **gen_kw, **kw)
    except hf_specdec.UnsupportedCacheError if hasattr(hf_specdec, "UnsupportedCacheError") else ValueError as e:
        rec(check, "refused", f"{type(e).__name__}: {e}"); return
    except Exception as e:
        rec(check, "CRASH", lib_frame(e)); traceback.print_exc(); return
    a, b = plain.sequences, out.sequences
    acc = out.acceptance
    info = f"tok/round={acc.mean_tokens_per_round:.2f}"
    if a.shape == b.shape and torch.equal(a, b):
        rec(check, "equal", info); return
    P = ids.shape[1]
    det = []
    for r in range(a.shape[0]):
        ra, rb = a[r], b[r]
        n = min(len(ra), len(rb))
        diff = (ra[:n] != rb[:n]).nonzero()
        if len(diff) == 0 and len(ra) == len(rb): continue
        k = int(diff[0]) if len(diff) else n
        step = k - P
        lg = plain.logits[step][r].float() if 0 <= step < len(plain.logits) else None
        margin = None
        if lg is not None:
            t2 = lg.topk(2).values; margin = float(t2[0] - t2[1])
        det.append(f"row{r}: first diff new-token {step} plain={ra[k].item() if k < len(ra) else None} spec={rb[k].item() if k < len(rb) else None} margin={margin}")
    rec(check, "MISMATCH", info + " ; " + " ; ".join(det))

def sample(check, target, draft, ids, mask=None, **kw):
    try:
        for s in range(3):
            torch.manual_seed(s)
            gen_kw = dict(do_sample=True, top_p=0.9, max_new_tokens=20)
            if mask is not None: gen_kw["attention_mask"] = mask
            out = target.generate(ids, custom_generate=hf_specdec.speculative_generate, assistant=draft, **gen_kw, **kw)
            assert out.shape[1] == ids.shape[1] + 20, out.shape
        rec(check, "ok")
    except ValueError as e:
        rec(check, "refused", f"{type(e).__name__}: {e}")
    except Exception as e:
        rec(check, "CRASH", lib_frame(e)); traceback.print_exc()

def batch_inputs(lens=(20, 9, 5), seed=7):
    g = torch.Generator().manual_seed(seed)
    W = max(lens)
    ids = torch.zeros(len(lens), W, dtype=torch.long); mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, W - n:] = torch.randint(2, V, (n,), generator=g); mask[i, W - n:] = 1
    return ids, mask

t0 = time.time()
try:
    target = build(arch)
except Exception as e:
    rec("build", "BUILD-FAIL", f"{type(e).__name__}: {e}"); traceback.print_exc()
    json.dump(results, open(os.path.join(OUT, f"res_{arch}.json"), "w")); sys.exit()
draft = perturbed(target, float(os.environ.get("NOISE", "0.05")))
settings = {"default": {}, "tree=False": dict(tree=False), "k3-nonadaptive": dict(num_draft_tokens=3, adaptive=False)}
for plen in (5, 70):
    ids = prompt(plen, plen)
    for name, kw in settings.items():
        compare(f"single P={plen} {name}", target, draft, ids, **kw)
import copy as _c
twin = _c.deepcopy(target)
compare("single P=70 k3-nonadaptive copy-draft", target, twin, prompt(70, 70), num_draft_tokens=3, adaptive=False)
compare("single P=70 k3-nonadaptive copy-draft window=None", target, twin, prompt(70, 70), num_draft_tokens=3, adaptive=False, draft_window=None)
compare("single P=70 default copy-draft", target, twin, prompt(70, 70))
compare("single P=5 tree=False copy-draft", target, twin, prompt(5, 5), tree=False)
try:
    small = build(arch, layers=1, seed=1)
    compare("single P=70 default 1-layer-draft", target, small, prompt(70, 70))
except Exception as e:
    rec("single P=70 1-layer-draft", "CRASH/BUILD", lib_frame(e))
ids, mask = batch_inputs()
compare("batch3 default", target, draft, ids, mask)
compare("batch3 k3-nonadaptive", target, draft, ids, mask, num_draft_tokens=3, adaptive=False)
compare("batch3 copy-draft", target, twin, ids, mask, num_draft_tokens=4, adaptive=False)
sample("sample single P=70", target, draft, prompt(70, 70))
# if sliding, also a wide-window variant for batches
from hf_specdec.arguments import _validate_layers
try:
    wins = _validate_layers(target, "target")
except Exception as e:
    wins = None
if wins or arch == "gpt_neo":
    try:
        tw = build(arch, window=512); dw = perturbed(tw, float(os.environ.get("NOISE", "0.05")))
        compare("batch3 window512 default", tw, dw, ids, mask)
        compare("batch3 window512 k3-nonadaptive", tw, dw, ids, mask, num_draft_tokens=3, adaptive=False)
        compare("batch3 window512 copy-draft", tw, _c.deepcopy(tw), ids, mask, num_draft_tokens=4, adaptive=False)
        sample("sample batch3 window512", tw, dw, ids, mask)
    except Exception as e:
        rec("window512", "CRASH/BUILD", lib_frame(e))
else:
    sample("sample batch3", target, draft, ids, mask)
print(f"[{arch}] done in {time.time()-t0:.0f}s")
json.dump(results, open(os.path.join(OUT, f"res_{arch}.json"), "w"))

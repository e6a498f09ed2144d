#!/usr/bin/env bash
# Accelerator figures for hf_specdec in one prepared command, sized for the device machine (the `device`
# tool: no network, the working tree up to 64 MiB, 10 minutes a command, results under $OUT).
#
#   bash evals/gpu_run.sh [OUT]     # OUT: $OUT if set, else the argument, else runs/gpu
#
# On a CUDA machine, with the machine's own torch (no download, nothing built; bf16, random weights):
#   1. evals/gpu_costs.py    the cost table of the real pair's architectures (evals/configs/*.json):
#                            target forwards over 1-64 new tokens at contexts 64/256/1024, batch 1-16,
#                            the draft's step, both prefills            -> OUT/costs/
#   2. evals/overhead.py     the loop's time per round outside forwards, hf_specdec against transformers
#                            (tiny models with the 152k vocabulary)      -> OUT/overhead/
#   3. evals/cuda_checks.py  syncs per round counted by CUDA (chains, trees, a batch), greedy identity on
#                            three architectures, a chi-square and its broken variant -> OUT/checks/
# and OUT/log.txt (everything printed, the machine and the versions).
#
# hf_specdec needs transformers >= 5.23; where the machine's is older (5.17 on the device machine) and
# nothing can be fetched, carry it with its needs that the machine lacks (huggingface_hub 2.x needs
# httpx2 and hf-xet, transformers 5.25 kernels): `evals/gpu_wheels.sh` downloads them into .whl here,
# then name `.whl` in the device tool's `carry`; every wheel there is installed with --no-deps into
# /tmp/site, ahead of the machine's own packages. Without a CUDA device the script makes a dry run: it prints this plan, checks every
# import, the configs (models built on the meta device) and each step's arguments, and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${1:-runs/gpu}}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"

transformers_ok() { "$PY" -c "import sys, transformers as t; v = tuple(int(x) for x in t.__version__.split('.')[:2]); sys.exit(0 if v >= (5, 23) else 1)"; }
if ! transformers_ok; then
  if ! ls .whl/transformers-*.whl >/dev/null 2>&1; then
    echo "evals/gpu_run.sh: transformers >= 5.23 is needed and no .whl/transformers-*.whl was carried (see the header)" >&2
    exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH#$PWD}"
  transformers_ok || { echo "evals/gpu_run.sh: the carried wheels did not give transformers >= 5.23" >&2; exit 1; }
fi

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "evals/gpu_run.sh: no CUDA device here: dry run (what would run, and whether it would start)"
  sed -n '5,15p' "$0" | sed 's/^# \{0,1\}/  /'
  "$PY" - "$OUT" <<'PYTHON' | sed 's/^/  /'
import sys
sys.path.insert(0, "evals")
import torch, transformers, hf_specdec
print("torch", torch.__version__, "| transformers", transformers.__version__, "| hf_specdec", hf_specdec.__version__)
import gpu_costs, cuda_checks, overhead  # every step's imports
gpu_costs.main(["--check", "--out", sys.argv[1]])
print("on a CUDA machine the three steps run (201 and 213 s on an H200, 2026-12-04)")
PYTHON
  exit 0
fi

{
  echo "== machine"; nvidia-smi -L || true
  "$PY" -c "import torch, transformers, hf_specdec; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| device', torch.cuda.get_device_name(0))"
  echo "== 1. cost table"
  timeout 200 "$PY" evals/gpu_costs.py --device cuda --out "$OUT/costs" || echo "== step failed with exit $? (the next steps run)"
  echo "== 2. loop overhead"
  timeout 150 "$PY" evals/overhead.py --device cuda --dtype bfloat16 --repeats 3 --out "$OUT/overhead" || echo "== step failed with exit $? (the next steps run)"
  echo "== 3. syncs, identity, chi-square"
  timeout 200 "$PY" evals/cuda_checks.py --device cuda --out "$OUT/checks" || echo "== step failed with exit $? (the next steps run)"
  echo "== done: $OUT"
} 2>&1 | tee "$OUT/log.txt"

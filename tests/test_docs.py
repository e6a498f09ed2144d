"""The README's code runs as written (on tiny models), and every recorded run the docs and the code
cite exists."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"evals/results/[A-Za-z0-9_./-]*[A-Za-z0-9_/-]")


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def test_readme_python_blocks_run_as_written_on_tiny_models():
    """The ten-line example runs alone; the later blocks run in a namespace holding what they assume
    (a target, its draft, a tokenizer, tokenized `inputs`, a list of `prompts`): the tiny offline pair."""
    sys.path.insert(0, str(ROOT / "evals"))
    from tiny import tiny_pair

    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 3
    exec(compile(blocks[0], "README.md:example", "exec"), {})
    target, draft, tokenizer = tiny_pair()
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    prompts = [tokenizer("abc")["input_ids"], tokenizer("hello there")["input_ids"]]
    namespace = dict(target=target, draft=draft, tokenizer=tokenizer, inputs=dict(inputs, max_new_tokens=8),
                     prompts=prompts, i=1)
    exec("import hf_specdec", namespace)
    for n, block in enumerate(blocks[1:], 1):
        exec(compile(block.replace("max_new_tokens=128", "max_new_tokens=8"), f"README.md:block{n}", "exec"), namespace)
    assert namespace["results"][1].ok and torch.is_tensor(namespace["results"][1].tokens)


def test_every_cited_results_path_exists():
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "hf_specdec").rglob("*.py")),
               *sorted((ROOT / "evals").glob("*.py"))]
    missing = {}
    for path in sources:
        for cited in CITED.findall(path.read_text()):
            if not (ROOT / cited).exists():
                missing.setdefault(cited, path.relative_to(ROOT).as_posix())
    assert not missing, missing


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_point_to_files_and_headings_that_exist():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+\.md)?(?:#([^)\s]+))?\)", page.read_text()):
            path, anchor = target
            if not path and not anchor:
                continue
            file = (page.parent / path) if path else page
            if not file.exists():
                broken.append(f"{page.name}: {path}")
                continue
            headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)}
            if anchor and anchor not in headings:
                broken.append(f"{page.name}: {path}#{anchor}")
    assert not broken, broken

"""The docs stay true: their Python examples run, and the configuration reference is current.

Every ```python block in docs/*.md runs, in a fresh namespace from the repository root, unless
the line before its fence is `<!-- no-run -->`. Blocks marked `<!-- needs-sglang -->` run
against the session's real SGLang fleet and get `fleet_addresses`, `api_key` and `model_dir`.
Shell blocks are never run. Registrations a block makes are undone afterwards.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from areal_like.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
FENCE = re.compile(r"^```python\s*$")
MARKERS = ("no-run", "needs-sglang")


def python_blocks(path: Path) -> list[tuple[int, str, str]]:
    """(first line number, marker or "", code) of every ```python block of `path`."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            prev = lines[i - 1].strip() if i else ""
            marker = next((m for m in MARKERS if prev == f"<!-- {m} -->"), "")
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError(f"{path.name}:{i + 1}: unterminated ```python block")
            blocks.append((i + 1, marker, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


CASES = [
    pytest.param(path, line, marker, code, id=f"{path.name}:{line}",
                 marks=[pytest.mark.sglang] if marker == "needs-sglang" else [])
    for path in sorted(DOCS.glob("*.md"))
    for line, marker, code in python_blocks(path)
    if marker != "no-run"
]


def test_docs_have_examples() -> None:
    assert any(marker == "" for _, _, marker, _ in (c.values for c in CASES))
    assert any(marker == "needs-sglang" for _, _, marker, _ in (c.values for c in CASES))


@pytest.mark.parametrize(("path", "line", "marker", "code"), CASES)
def test_doc_example_runs(path: Path, line: int, marker: str, code: str,
                          request: pytest.FixtureRequest,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    if marker == "needs-sglang":
        from conftest import SGLANG_TEST_API_KEY

        fleet = request.getfixturevalue("sglang_fleet")
        namespace.update(fleet_addresses=list(fleet.addresses), api_key=SGLANG_TEST_API_KEY,
                         model_dir=str(request.getfixturevalue("tiny_model_dir")))
    monkeypatch.chdir(REPO)
    registered = (set(ADVANTAGE_ESTIMATORS.names()), set(POLICY_LOSSES.names()))
    try:
        exec(compile(code, f"{path}:{line}", "exec"), namespace)
    finally:
        for registry, before in zip((ADVANTAGE_ESTIMATORS, POLICY_LOSSES), registered, strict=True):
            for name in set(registry.names()) - before:
                registry.unregister(name)


def test_configuration_reference_is_current() -> None:
    from recipes.config_docs import render

    committed = (DOCS / "configuration.md").read_text()
    assert committed == render(), (
        "docs/configuration.md is stale: run "
        "`python -m recipes.config_docs --write docs/configuration.md`")


def test_block_parser_reads_markers(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("text\n<!-- no-run -->\n```python\nraise SystemExit\n```\n\n"
                   "```python\nx = 1\n```\n```bash\nls\n```\n")
    assert python_blocks(doc) == [(3, "no-run", "raise SystemExit\n"), (7, "", "x = 1\n")]

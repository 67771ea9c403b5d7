"""docs/configuration.md is the option table's own rendering (``statectl config docs``), never edited by hand."""

from __future__ import annotations

from pathlib import Path

from keyedstate.common.config import options as o

DOCS = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_the_reference_is_current() -> None:
    assert DOCS.read_text() == o.docs_markdown(), (
        "docs/configuration.md is stale: regenerate it with `statectl config docs > docs/configuration.md`"
    )


def test_every_key_is_documented_once() -> None:
    keys = [line.split("`")[1] for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    assert len(keys) == len(set(keys)) == len(o.ALL)

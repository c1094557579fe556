"""The API reference builds from the docstrings with no pdoc warning and no broken link (so it
cannot rot), and documents the objects a user calls."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("perflab_api_docs", ROOT / "docs" / "api.py")
api = importlib.util.module_from_spec(spec)
spec.loader.exec_module(api)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    return out, api.build(out)


def _text(page: Path) -> str:
    return re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8"))


def test_the_reference_builds_and_documents_what_a_user_calls(built):
    out, pages = built
    names = {p.relative_to(out).as_posix() for p in pages}
    for mod in api.MODULES:
        assert mod.replace(".", "/") + ".html" in names, mod
    want = {
        "lab_utils/traces/analysis.html": ["TraceAnalysis", "temporal", "top_kernels", "collectives"],
        "lab_utils/step/contract.html": ["StepFactory", "make_batch", "block_class"],
        "lab_utils/run/compare/rules.html": ["direction", "METRIC_RULES"],
        "lab_utils/run/commands/compare.html": ["Options", "threshold", "max_unstable_share"],
        "lab_utils/core/records.html": ["Recorder", "ROW_COLUMNS", "CONTEXT_COLUMNS", "load_records"],
        "lab_utils/run/cli.html": ["perflab trace PATH", "perflab export REPORT"],
    }
    for page, words in want.items():
        text = _text(out / page)
        missing = [w for w in words if w not in text]
        assert not missing, f"{page} does not document {missing}"
    # reStructuredText roles are rendered, not left as text
    assert not [p for p in pages if ":func:`" in _text(p) or ":class:`" in _text(p)]
    assert 'href="../core/records.html#Recorder"' in (out / "lab_utils/traces/analysis.html").read_text()


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.html").write_text('<h1 id="top">x</h1><a href="../b.html#nope"></a><a href="#top"></a>')
    (tmp_path / "b.html").write_text(
        '<a href="a/x.html#top"></a><a href="gone.html"></a><a href="https://pdoc.dev"></a>'
    )
    assert sorted(api.broken_links(tmp_path)) == [
        "a/x.html: ../b.html#nope (no such anchor)",
        "b.html: gone.html (no such page)",
    ]

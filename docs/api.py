"""Build perflab's API reference from its docstrings (pdoc): the objects a user calls.

    .venv/bin/python docs/api.py [OUT]        # default build/api; open OUT/index.html

The pages: ``TraceAnalysis`` and the trace reader (``lab_utils.traces``), ``StepFactory`` and
``load_step`` (your own training step), the compare rules and ``Options`` (``perflab compare``), the
records schema (``Recorder``, the row and context columns, ``load_records``), the ``perflab``
command and each subcommand's arguments, and the export to MLflow / TensorBoard.  A build fails
on any warning pdoc gives and on any link between the pages that points nowhere
(``tests/tools/test_api_docs.py`` builds it in ``make test``).
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pdoc
import pdoc.render

ROOT = Path(__file__).resolve().parents[1]
#: the modules documented, in the order the index lists them
MODULES = (
    "lab_utils.traces.analysis",
    "lab_utils.traces.reader",
    "lab_utils.traces.phases",
    "lab_utils.step.contract",
    "lab_utils.step.load",
    "lab_utils.run.compare.rules",
    "lab_utils.run.commands.compare",
    "lab_utils.core.records",
    "lab_utils.core.samples",
    "lab_utils.run.cli",
    "lab_utils.run.commands.run",
    "lab_utils.run.commands.trace",
    "lab_utils.run.commands.export",
    "lab_utils.run.export",
)
HREF = re.compile(r'href="([^"#]*)(?:#([^"]*))?"')


def broken_links(out: Path) -> list[str]:
    """Links between the pages under ``out`` whose file or anchor does not exist."""
    ids: dict[Path, set[str]] = {}
    bad = []
    pages = sorted(out.rglob("*.html"))
    for page in pages:
        ids[page.resolve()] = set(re.findall(r'\bid="([^"]+)"', page.read_text(encoding="utf-8")))
    for page in pages:
        for target, anchor in HREF.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http:", "https:", "mailto:", "data:")) or "${" in target:
                continue
            dest = (page.parent / target).resolve() if target else page.resolve()
            if dest not in ids:
                bad.append(f"{page.relative_to(out)}: {target} (no such page)")
            elif anchor and anchor not in ids[dest]:
                bad.append(f"{page.relative_to(out)}: {target}#{anchor} (no such anchor)")
    return bad


def _from_pdoc(w: warnings.WarningMessage) -> bool:
    """A warning pdoc gave (a docstring it cannot render, a name it cannot resolve), not one an
    imported library gives on import."""
    return "pdoc" in str(w.filename or "") or "pdoc" in str(w.message)


def build(out: Path) -> list[Path]:
    """Write the reference into ``out``; raises on a pdoc warning or a broken link."""
    out = Path(out)
    pdoc.render.configure(docformat="restructuredtext", show_source=False, search=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*MODULES, output_directory=out)
    said = [f"{w.category.__name__}: {w.message}" for w in caught if _from_pdoc(w)]
    if said:
        raise RuntimeError("pdoc warned:\n" + "\n".join(said))
    bad = broken_links(out)
    if bad:
        raise RuntimeError("broken links in the API reference:\n" + "\n".join(bad))
    return sorted(out.rglob("*.html"))


if __name__ == "__main__":
    dest = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "build" / "api"
    pages = build(dest)
    print(f"API reference: {len(pages)} pages in {dest} (open {dest / 'index.html'})")

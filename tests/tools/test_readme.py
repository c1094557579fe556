"""The README starts with the user (what perflab is, the two commands and what they print, a picture
of a report, then the labs, your model, your traces, the cluster), development material lives in
docs/, every relative link resolves and every ``perflab`` command in a shell block parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from PIL import Image

from lab_utils.run import cli

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = {
    p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
}


def headings(text: str) -> list[str]:
    return re.findall(r"^## (.+)$", text, flags=re.M)


def test_the_first_screen_is_for_a_user():
    first = "\n".join(README.splitlines()[:60])
    assert first.startswith("# perflab\n\nperflab is a performance lab")
    assert "make report" in first and "make test" in first
    assert "report: " in first and "records)" in first, "what `make report` prints"
    assert "](docs/report.png)" in first
    for dev in ("mutation", "durations", "Layout", "pytest --", "kill rate"):
        assert dev not in first, f"developer material on the first screen: {dev!r}"


def test_the_sections_come_in_the_users_order_and_development_material_is_in_docs():
    h = headings(README)
    order = ["The labs", "Your model", "Traces from your GPU jobs", "Cluster", "Developing perflab"]
    assert [x for x in h if x in order] == order, h
    for gone in ("How strong the tests are: the mutation benchmark", "Layout", "What it is for"):
        assert gone not in h, gone
    assert "### GPU check" not in README and "wheel recipe" not in README
    dev, gpu = DOCS["docs/development.md"], DOCS["docs/gpu.md"]
    assert "How strong the tests are: the mutation benchmark" in headings(dev) and "Layout" in headings(dev)
    assert "benchmarks/mutation.py" in dev and "15 min 28 s" in dev
    assert "The GPU check (one command, a short GPU run)" in headings(gpu) and "pip download --no-deps" in gpu
    assert "CUDA 13.0" in gpu and "R580" in gpu


def test_the_report_picture_is_a_small_real_screenshot():
    png = ROOT / "docs" / "report.png"
    assert png.stat().st_size < 250_000
    with Image.open(png) as im:
        assert im.format == "PNG" and im.size == (1280, 860)
        assert len(im.convert("RGB").getcolors(1 << 16) or []) > 8  # a page, not a blank image


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_relative_link_resolves(doc):
    base = (ROOT / doc).parent
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", DOCS[doc]):
        if target.startswith(("http:", "https:", "mailto:")):
            continue
        assert (base / target).exists(), f"{doc}: link to {target} points nowhere"


def perflab_commands(text: str) -> list[list[str]]:
    """Every ``perflab ...`` command of the text's bash blocks, as argument lists."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].split(" # ")[0].strip()
            for part in re.split(r"&&|\|", line):
                words = shlex.split(part.strip()) if part.strip() else []
                if words and words[0] in ("perflab", ".venv/bin/perflab", "$(BIN)/perflab"):
                    out.append(words[1:])
    return out


def test_every_perflab_command_in_the_docs_parses():
    parser = cli.parser()
    seen = 0
    for text in DOCS.values():
        for argv in perflab_commands(text):
            if argv[:2] == ["trace", "diff"]:
                cli.trace.parser(diff=True).parse_args(argv[2:])
            else:
                cut = argv.index("--") if argv[:1] == ["lab"] and "--" in argv else len(argv)
                parser.parse_args(argv[:cut])
            seen += 1
    assert seen >= 15, seen

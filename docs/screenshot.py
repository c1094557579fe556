"""The README's picture of a report: a headless-Chromium screenshot of a finished report's index.

    .venv/bin/python docs/screenshot.py reports/latest [docs/report.png]

Debian's ``chromium`` (``apt-get install -y chromium``), driven by playwright (perflab[dev]); as root
Chromium needs ``--no-sandbox``.  The page is loaded from disk (no server, no network), its first
1280 x 860 pixels kept and quantized to a 256-colour PNG so the file stays small.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from PIL import Image
from playwright.sync_api import sync_playwright

VIEWPORT = {"width": 1280, "height": 860}


def screenshot(report: Path, out: Path) -> Path:
    index = (Path(report) / "index.html").resolve()
    if not index.is_file():
        raise SystemExit(f"{report}: no index.html (give a finished report folder)")
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("chromium is not installed (apt-get install -y chromium)")
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    raw = out.with_suffix(".raw.png")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=args)
        page = browser.new_page(viewport=VIEWPORT, device_scale_factor=1)
        page.goto(index.as_uri())
        page.wait_for_load_state("load")
        page.screenshot(path=str(raw))
        browser.close()
    Image.open(raw).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    raw.unlink()
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    dest = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parent / "report.png"
    print(f"wrote {screenshot(Path(sys.argv[1]), dest)} ({dest.stat().st_size / 1e3:.0f} kB)")

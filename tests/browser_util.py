"""Headless Chromium (Debian's package) driven by playwright, for the real-browser tests.

Playwright's own browser download does not work here (no network), so the
browser is the system ``chromium`` (``apt-get install chromium chromium-driver``),
launched with a fresh user-data dir and with every background-network feature off.
Every request a page makes is watched: anything that is not ``file:``/``data:``/
``blob:``/``about:`` or a loopback address is recorded and aborted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LOCAL_SCHEMES = {"file", "data", "blob", "about", "chrome-error", "devtools"}
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def chromium_path() -> str | None:
    return shutil.which("chromium")


def skip_reason() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if chromium_path() is None:
        return (
            "Chromium is not installed (`apt-get install chromium chromium-driver`; .ci/run installs it): "
            "real-browser tests skipped"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install -e '.[dev]'): real-browser tests skipped"
    return None


def is_outside(url: str) -> bool:
    u = urlparse(url)
    if u.scheme in LOCAL_SCHEMES:
        return False
    if u.scheme in ("http", "https", "ws", "wss"):
        return (u.hostname or "") not in LOOPBACK_HOSTS
    return True


@contextlib.contextmanager
def browser(user_data_dir: str | Path, *, viewport=(1400, 1000)):
    """A persistent Chromium context on a fresh user-data dir; outside requests are aborted
    (and recorded by ``Watch``)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(user_data_dir),
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": viewport[0], "height": viewport[1]},
            service_workers="block",
        )
        blocked: list[str] = []

        def route(r):
            if is_outside(r.request.url):
                blocked.append(r.request.url)
                r.abort()
            else:
                r.continue_()

        ctx.route("**/*", route)
        ctx.blocked = blocked  # type: ignore[attr-defined]
        try:
            yield ctx
        finally:
            ctx.close()


@dataclass
class Watch:
    """Console errors, uncaught page errors and outside requests of one page."""

    errors: list[str] = field(default_factory=list)
    outside: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    @classmethod
    def on(cls, page) -> Watch:
        w = cls()
        page.on("console", lambda m: w.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: w.errors.append(f"uncaught: {e}"))
        page.on("request", w._request)
        return w

    def _request(self, req):
        self.requests.append(req.url)
        if is_outside(req.url):
            self.outside.append(req.url)


# Walks open shadow roots (BokehJS renders each view in one): every bk-Figure / bk-Plot
# with its canvases, and whether something beyond one flat colour was drawn.
PLOTS_JS = r"""
() => {
  const figs = [];
  const walk = (root) => { for (const el of root.querySelectorAll('*')) {
      const cl = el.classList;
      if (cl && (cl.contains('bk-Figure') || cl.contains('bk-Plot') || cl.contains('bk-GMapPlot'))) figs.push(el);
      if (el.shadowRoot) walk(el.shadowRoot); } };
  walk(document);
  return figs.map((fig, i) => {
    const canvases = [];
    const walk2 = (root) => { for (const el of root.querySelectorAll('*')) {
        if (el.tagName === 'CANVAS') canvases.push(el); if (el.shadowRoot) walk2(el.shadowRoot); } };
    if (fig.shadowRoot) walk2(fig.shadowRoot); walk2(fig);
    let w = 0, h = 0, colours = 0, painted = 0;
    for (const c of canvases) {
      if (!c.width || !c.height) continue;
      w = Math.max(w, c.width); h = Math.max(h, c.height);
      const ctx = c.getContext('2d'); if (!ctx) continue;
      const d = ctx.getImageData(0, 0, c.width, c.height).data; const seen = new Set();
      for (let k = 0; k < d.length; k += 4 * 5) {
        if (d[k + 3] > 0) { painted++; seen.add((d[k] << 16) | (d[k + 1] << 8) | d[k + 2]); }
        if (seen.size > 8) break; }
      colours = Math.max(colours, seen.size);
    }
    const r = fig.getBoundingClientRect();
    return {index: i, cls: String(fig.className), canvases: canvases.length, width: w, height: h,
            colours: colours, painted: painted, visible: r.width > 0 && r.height > 0};
  });
}
"""

# A fingerprint of every canvas under an element (plots change => fingerprint changes).
CANVAS_PRINT_JS = r"""
(root) => {
  const out = [];
  const walk = (r) => { for (const el of r.querySelectorAll('*')) {
      if (el.tagName === 'CANVAS' && el.width && el.height) out.push(el.toDataURL());
      if (el.shadowRoot) walk(el.shadowRoot); } };
  walk(root || document);
  let h = 0; for (const s of out) for (let i = 0; i < s.length; i += 7) h = (h * 31 + s.charCodeAt(i)) | 0;
  return out.length + ':' + h;
}
"""


def plots(page) -> list[dict]:
    return page.evaluate(PLOTS_JS)


def undrawn(ps: list[dict]) -> list[dict]:
    """Plots with no canvas, zero size, or only one flat colour."""
    return [
        p
        for p in ps
        if not (p["canvases"] and p["width"] > 0 and p["height"] > 0 and p["visible"] and p["colours"] >= 2)
    ]


def wait_for_plots(page, expected: int, timeout_s: float = 60) -> list[dict]:
    """Poll until at least ``expected`` plots exist and all are drawn (or time out)."""
    deadline = time.monotonic() + timeout_s
    ps = plots(page)
    while time.monotonic() < deadline:
        ps = plots(page)
        if len(ps) >= expected and not undrawn(ps):
            # one more frame so a plot still being laid out is not caught half-drawn
            page.wait_for_timeout(300)
            return plots(page)
        page.wait_for_timeout(250)
    return ps


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LabServer:
    url: str
    token: str
    proc: subprocess.Popen
    log: Path


NOTIFY_SETTINGS = '{"fetchNews": "false", "checkForUpdates": false}'
DOCMANAGER_SETTINGS = '{"autosave": false}'


@contextlib.contextmanager
def jupyter_lab(root_dir: Path, work: Path, *, timeout_s: float = 120):
    """JupyterLab on ``root_dir`` at a free loopback port with its own token and its own
    runtime/config/settings dirs under ``work``; stopped (and waited for) on exit."""
    import secrets

    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    for name in (
        "runtime",
        "config",
        "ipython",
        "settings/@jupyterlab/apputils-extension",
        "settings/@jupyterlab/docmanager-extension",
        "workspaces",
    ):
        (work / name).mkdir(parents=True, exist_ok=True)
    (work / "settings/@jupyterlab/apputils-extension/notification.jupyterlab-settings").write_text(NOTIFY_SETTINGS)
    (work / "settings/@jupyterlab/docmanager-extension/plugin.jupyterlab-settings").write_text(DOCMANAGER_SETTINGS)
    env.update(
        JUPYTER_RUNTIME_DIR=str(work / "runtime"),
        JUPYTER_CONFIG_DIR=str(work / "config"),
        IPYTHONDIR=str(work / "ipython"),
        JUPYTER_PLATFORM_DIRS="1",
        PYTHONUNBUFFERED="1",
    )
    log = work / "jupyter.log"
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root_dir}",
        f"--LabApp.user_settings_dir={work / 'settings'}",
        f"--LabApp.workspaces_dir={work / 'workspaces'}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        "--ServerApp.terminals_enabled=False",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            cmd, cwd=str(root_dir), env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not answer within {timeout_s} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield LabServer(url=url, token=token, proc=proc, log=log)
    finally:
        if proc.poll() is None:
            try:  # a clean shutdown stops the kernels too
                req = urllib.request.Request(
                    f"{url}/api/shutdown", method="POST", headers={"Authorization": f"token {token}"}
                )
                urllib.request.urlopen(req, timeout=5).close()
                proc.wait(timeout=20)
            except Exception:  # noqa: BLE001
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)

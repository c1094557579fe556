"""``make lab`` (``perflab lab``): JupyterLab on working copies of the labs, never on the committed ones.

The committed notebooks in ``labs/`` keep the outputs nbval checks (``# NBVAL_CHECK_OUTPUT``) and
nothing else; JupyterLab's autosave would write every plot and explorer payload into them. So the
lab opens ``work/labs/`` (git-ignored), where each ``labs/*.ipynb`` is copied on first use:

* a copy already there is kept, never overwritten, so an afternoon of exploration survives;
* a lab changed in ``labs/`` since its copy was made is reported, not silently replaced;
  ``perflab lab --reset [NAME ...]`` (``make lab-reset``) or removing the copy gives a fresh one.

The kernel imports the project from its editable install, whatever its folder; ``rec.save()`` in
a working copy writes under ``work/labs/.perflab/``, which is ignored too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LABS_DIR = ROOT / "labs"
WORK_DIR = ROOT / "work" / "labs"
#: which content of ``labs/`` each copy was made from (name -> sha256), to tell a stale copy
MANIFEST = ".perflab-sources.json"


@dataclass
class Prepared:
    """What :func:`prepare` did, by notebook file name."""

    folder: Path
    copied: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = []
        if self.copied:
            out.append(f"copied to {self.folder}: {', '.join(self.copied)}")
        if self.kept:
            out.append(f"kept your working copies: {', '.join(self.kept)}")
        for name in self.stale:
            out.append(
                f"note: labs/{name} changed since {self.folder / name} was copied; your copy is kept "
                f"(fresh copy: `make lab-reset LAB={Path(name).stem}` or remove the copy)"
            )
        return out


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_manifest(folder: Path) -> dict[str, str]:
    try:
        data = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def prepare(labs: Path = LABS_DIR, folder: Path = WORK_DIR, *, reset: bool | list[str] = False) -> Prepared:
    """Copy every ``labs/*.ipynb`` that has no working copy in ``folder`` yet (created on first use).

    An existing copy is kept; it is reported stale when its lab in ``labs/`` differs from the
    content it was copied from (for a copy made without the manifest: when the lab is newer).
    ``reset``: True replaces every copy, a list of names (``05_memory`` or ``05_memory.ipynb``)
    only those."""
    labs, folder = Path(labs), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = _read_manifest(folder)
    wanted = {Path(n).stem for n in reset} if isinstance(reset, list) else set()
    sources = sorted(labs.glob("*.ipynb"))
    unknown = wanted - {p.stem for p in sources}
    if unknown:
        raise ValueError(f"no such lab in {labs}: {', '.join(sorted(unknown))}")
    done = Prepared(folder)
    for src in sources:
        dst = folder / src.name
        digest = _digest(src)
        if dst.exists() and not (reset is True or src.stem in wanted):
            done.kept.append(src.name)
            known = manifest.get(src.name)
            changed = known != digest if known else src.stat().st_mtime > dst.stat().st_mtime
            if changed:
                done.stale.append(src.name)
            continue
        shutil.copyfile(src, dst)  # a fresh mtime: the copy is newer than its lab
        manifest[src.name] = digest
        done.copied.append(src.name)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return done


def lab_argv(folder: Path, extra: list[str] | None = None, *, uid: int | None = None) -> list[str]:
    """The command that opens JupyterLab on ``folder``; as root (uid 0, usual in GPU containers)
    JupyterLab refuses to start without ``--allow-root``."""
    uid = os.geteuid() if uid is None else uid
    argv = [sys.executable, "-m", "jupyter", "lab", f"--notebook-dir={folder}"]
    if uid == 0:
        argv.append("--allow-root")
    return argv + list(extra or [])


def launch(a, extra: list[str] | None = None) -> int:
    """``perflab lab`` on parsed arguments (``lab_utils.run.commands.lab``); ``extra``: the arguments
    after ``--``, for ``jupyter lab``."""
    try:
        done = prepare(LABS_DIR, a.dir, reset=(a.reset or True) if a.reset is not None else False)
    except ValueError as e:
        print(f"perflab lab: {e}", file=sys.stderr)
        return 2
    for line in done.lines():
        print(line)
    if a.reset is not None or a.prepare_only:
        return 0
    cmd = lab_argv(a.dir, extra)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 0  # not reached

""".ci/run on a machine without the SLURM packages: it installs them (their services left stopped), and
where they cannot be installed it says so and runs the tests all the same, which then skip with the reason.

The machine is made to lack them by mounting an empty folder over /usr/sbin in a mount namespace of the
test's own (``unshare -m``, as root); ``apt-get``, ``make`` and ``id`` are stand-ins that record how they
were called."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import slurm_cluster as SC

ROOT = Path(__file__).resolve().parents[2]
SLURM = "slurm-wlm slurm-client slurmdbd munge mariadb-server"


def _shims(d: Path, apt_rc: int, uid: int) -> Path:
    d.mkdir()
    log = d / "calls.log"
    shims = {
        # what apt-get was asked, and whether a policy stopped the packages' services from starting then
        "apt-get": f'echo "apt-get $* policy=$(cat /usr/sbin/policy-rc.d 2>/dev/null | tail -n 1)" >> {log}\n'
        f"exit {apt_rc}\n",
        "make": f'echo "make $*" >> {log}\n',
        "id": f"echo {uid}\n",
        "chromium": "exit 0\n",  # present: the browser branch is not what this test is about
    }
    for name, body in shims.items():
        (d / name).write_text("#!/bin/sh\n" + body)
        (d / name).chmod(0o755)
    return log


def _ci_run(tmp_path: Path, apt_rc: int = 0, uid: int = 0) -> tuple[subprocess.CompletedProcess, str, list[str]]:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("hides /usr/sbin in a mount namespace of its own: needs root and unshare")
    empty = tmp_path / "empty-sbin"
    empty.mkdir()
    hide = f"mount --bind {empty} /usr/sbin"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", hide], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:  # a container without CAP_SYS_ADMIN
        pytest.skip(f"no mount namespace here: {probe.stderr.strip()}")
    log = _shims(tmp_path / "bin", apt_rc, uid)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:/usr/local/bin:/usr/bin:/bin"}
    script = f"{hide} && exec {ROOT / '.ci' / 'run'}"
    p = subprocess.run(["unshare", "-m", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return p, p.stdout + p.stderr, calls


def test_ci_installs_the_slurm_packages_with_their_services_left_stopped(tmp_path):
    p, out, calls = _ci_run(tmp_path)
    assert p.returncode == 0, out
    install = [c for c in calls if c.startswith("apt-get install")]
    assert len(install) == 1 and install[0].split(" policy=")[0].endswith(SLURM), calls
    assert install[0].endswith("policy=exit 101"), install  # invoke-rc.d starts none of their services
    assert calls[0].startswith("apt-get update") and calls[-1] == "make test", calls
    assert not (tmp_path / "empty-sbin" / "policy-rc.d").exists(), "the policy outlived the install"


@pytest.mark.parametrize("why", ["apt fails", "not root"])
def test_ci_goes_on_when_the_packages_cannot_be_installed_and_the_tests_skip_saying_why(why, tmp_path, monkeypatch):
    p, out, calls = _ci_run(tmp_path, apt_rc=100 if why == "apt fails" else 0, uid=0 if why == "apt fails" else 1000)
    assert p.returncode == 0 and calls[-1] == "make test", (out, calls)
    said = "failed; the SLURM cluster tests will be skipped" if why == "apt fails" else "cannot be installed here"
    assert said in out, out
    # what the cluster tests then say (tests/slurm_cluster.py), instead of failing
    monkeypatch.setattr(SC, "_which", lambda name: None)
    assert SC.missing() == "munged is not installed (apt-get install slurm-wlm munge; .ci/run does)"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert SC.missing() == "the SLURM test cluster runs its daemons as root (this is not root)"

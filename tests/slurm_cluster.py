"""A real two-node SLURM cluster on this machine, for the job tests (Debian's ``slurm-wlm`` and ``munge``).

:func:`start` brings up, as root, in a fresh folder of its own (nothing under /etc or /run is used,
so it runs beside any other SLURM or munge on the machine, and beside another test session's
cluster): ``munged`` on its own socket and key, ``slurmctld`` and two ``slurmd`` (``-N n1``,
``-N n2``) from one ``slurm.conf`` (``NodeName=n[1-2] NodeHostname=localhost Port=[a-b]``, 2 CPUs
each, ``proctrack/linuxproc``, ``task/none``, ``select/cons_tres``), partitions ``debug`` (the
default) and ``urgent`` (same nodes, a higher priority tier that preempts ``debug`` jobs by
requeueing them), and waits until ``sinfo`` shows both nodes idle.  With ``accounting=True`` it
also starts a MariaDB server on a loopback port and ``slurmdbd`` on it (SLURM 22.05 keeps
accounting only in MySQL/MariaDB: ``accounting_storage/slurmdbd`` + ``accounting_storage/mysql``),
registers the cluster, an account ``proj1`` for root and enforces associations; that
configuration also gives each node two fake GPUs (``gres.conf`` ``File=`` naming character devices made in the
folder, copies of /dev/null's), so that GPU binding and ``--gpus-per-node`` checks run against a real slurmctld.
:meth:`Cluster.stop` ends every daemon it started (by pid) and removes the folder.  A watcher
process (:func:`reap_when_gone`) does the same if the process that started the cluster dies without
stopping it (a test session killed at its timeout): no daemon, job step or folder outlives it.

Clients find the cluster through ``SLURM_CONF`` (:attr:`Cluster.env`).  Run by hand::

    python tests/slurm_cluster.py [--accounting]   # starts one, prints its SLURM_CONF, stops on Enter
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge")
DBD_PACKAGES = ("slurmdbd", "mariadb-server")
DAEMONS = ("munged", "slurmctld", "slurmd")
DBD_DAEMONS = ("slurmdbd", "mariadbd", "mariadb-install-db")
CLUSTER = "perflab"
ACCOUNT = "proj1"
PARTITION = "debug"
URGENT = "urgent"
MAX_TIME_MIN = 10  # the debug partition's MaxTime: a longer --time-limit is refused
NODE_CPUS = 2
NODE_MEM_MB = 8000  # what slurmd may grant a job (--mem); the machine has more, and memory is not consumed (CR_CPU)
FAKE_GPUS = 2  # per node, with accounting


def _which(name: str) -> str | None:
    """A daemon's path (they live in sbin, which a CI shell's PATH may leave out)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])
    return shutil.which(name, path=path)


def missing() -> str:
    """Why a cluster cannot start here ("" when it can)."""
    if os.geteuid() != 0:
        return "the SLURM test cluster runs its daemons as root (this is not root)"
    for d in DAEMONS:
        if not _which(d):
            return f"{d} is not installed (apt-get install {' '.join(PACKAGES)}; .ci/run does)"
    return ""


def missing_accounting() -> str:
    why = missing()
    for d in DBD_DAEMONS:
        if not why and not _which(d):
            why = f"{d} is not installed (apt-get install {' '.join(DBD_PACKAGES)}; .ci/run does)"
    return why


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free TCP ports on the loopback (slurm.conf's node Port range is consecutive)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return list(range(base, base + n))
    raise RuntimeError("no run of free ports on 127.0.0.1")


@dataclass
class Cluster:
    root: Path
    accounting: bool
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    watcher: subprocess.Popen | None = None  # reap_when_gone, should this process die first

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return subprocess.run(
            list(cmd), env={**os.environ, **self.env}, capture_output=True, text=True, check=check, timeout=timeout
        )

    def log(self, name: str) -> str:
        f = self.root / "log" / f"{name}.log"
        return f.read_text(errors="replace") if f.exists() else f"(no {f})"

    def _start(self, name: str, cmd: list[str]) -> None:
        cmd = [_which(cmd[0]) or cmd[0], *cmd[1:]]
        out = (self.root / "log" / f"{name}.out").open("w")
        self.procs[name] = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env}, start_new_session=True
        )

    def _wait_for(self, what: str, ok, timeout: float = 60, daemons: tuple[str, ...] = ()) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for d in daemons:
                p = self.procs[d]
                if p.poll() is not None:
                    raise RuntimeError(f"{d} exited ({p.returncode}) while waiting for {what}:\n{self.tail(d)}")
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                if ok():
                    return
            time.sleep(0.3)
        raise RuntimeError(f"timed out waiting for {what}:\n" + "\n".join(self.tail(d) for d in daemons))

    def tail(self, name: str, n: int = 3000) -> str:
        text = ""
        for f in (self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"):
            if f.exists():
                text += f"--- {f.name}\n" + f.read_text(errors="replace")[-n:]
        return text

    def idle_nodes(self) -> list[str]:
        out = self.run("sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %t", check=False).stdout
        return sorted(ln.split()[0] for ln in out.splitlines() if ln.split()[1:] == ["idle"])

    def wait_idle(self, timeout: float = 60) -> None:
        """Until both nodes are idle (after a test that left jobs: they have ended)."""
        self._wait_for("both nodes idle", lambda: self.idle_nodes() == ["n1", "n2"], timeout, ("slurmctld",))

    def jobs(self) -> list[str]:
        """Jobs slurmctld still runs or queues (``squeue``)."""
        return self.run("squeue", "-h", "-o", "%i %T %j").stdout.split("\n")[:-1]

    def stop(self) -> None:
        """SIGTERM every daemon this cluster started (by pid), SIGKILL what remains, remove the folder."""
        for name in ("slurmd-n2", "slurmd-n1", "slurmctld", "slurmdbd", "mariadbd", "munged"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        # job steps (slurmstepd) are children of a slurmd: ended with it, or still draining
        for pid in _pids_naming(str(self.root)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)
        if self.watcher is not None:
            self.watcher.wait(timeout=10)  # killed above (it names the folder)


def reap_when_gone(owner: int, root: Path, poll_s: float = 1.0) -> None:
    """Wait while ``owner`` (the process that started the cluster) lives and ``root`` exists; if the
    owner dies first, kill every process naming ``root`` (daemons, job steps, jobs) and remove it."""
    while root.exists():
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            for pid in _pids_naming(str(root)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(root, ignore_errors=True)
            return
        time.sleep(poll_s)


def _pids_naming(text: str) -> list[int]:
    """Processes whose command line or environment (a daemon's SLURM_CONF) names ``text``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            with contextlib.suppress(OSError):
                seen = Path(f"/proc/{d}/cmdline").read_bytes() + Path(f"/proc/{d}/environ").read_bytes()
                if text.encode() in seen:
                    out.append(int(d))
    return out


def _slurm_conf(c: Cluster, ctld: int, nodes: tuple[int, int], dbd: int | None) -> str:
    r = c.root
    acct = (
        f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=localhost\n"
        f"AccountingStoragePort={dbd}\nAccountingStoragePass={r}/munge/munge.socket\n"
        "AccountingStorageEnforce=associations\n"
        "JobAcctGatherType=jobacct_gather/linux\nJobAcctGatherFrequency=30\nGresTypes=gpu\n"
        if dbd
        else "AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n"
    )
    gres = f" Gres=gpu:{FAKE_GPUS}" if dbd else ""
    node = (
        f"NodeName=n[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[{nodes[0]}-{nodes[1]}] CPUs={NODE_CPUS} "
        f"SocketsPerBoard=1 CoresPerSocket={NODE_CPUS} ThreadsPerCore=1 RealMemory={NODE_MEM_MB}{gres} State=UNKNOWN"
    )
    return f"""# written by tests/slurm_cluster.py
ClusterName={CLUSTER}
SlurmctldHost=localhost
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
KillWait=5
MessageTimeout=20
JobCompType=jobcomp/none
{acct}
{node}
PartitionName={PARTITION} Nodes=n[1-2] Default=YES MaxTime={MAX_TIME_MIN} PriorityTier=1 State=UP
PartitionName={URGENT} Nodes=n[1-2] MaxTime={MAX_TIME_MIN} PriorityTier=2 PreemptMode=OFF State=UP
"""


def _start_munge(c: Cluster) -> None:
    d = c.root / "munge"
    d.mkdir(mode=0o700)
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    c._start(
        "munged",
        ["munged", "-F", "--force", f"--socket={d}/munge.socket", f"--key-file={key}",
         f"--pid-file={d}/munged.pid", f"--log-file={c.root}/log/munged.log", f"--seed-file={d}/munge.seed"],
    )  # fmt: skip
    c._wait_for("munged's socket", lambda: (d / "munge.socket").exists(), 30, ("munged",))


def _start_accounting(c: Cluster, dbd_port: int, db_port: int) -> None:
    db = c.root / "db"
    subprocess.run(
        [_which("mariadb-install-db") or "mariadb-install-db", f"--datadir={db}",
         "--auth-root-authentication-method=normal", "--skip-test-db",
         "--user=root"],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    c._start(
        "mariadbd",
        ["mariadbd", "--no-defaults", f"--datadir={db}", "--user=root", f"--socket={c.root}/run/mysqld.sock",
         f"--pid-file={c.root}/run/mysqld.pid", f"--port={db_port}", "--bind-address=127.0.0.1",
         "--skip-name-resolve", "--innodb-buffer-pool-size=16M", "--innodb-log-file-size=8M",
         "--performance-schema=OFF", "--skip-log-bin", f"--log-error={c.root}/log/mariadbd.log"],
    )  # fmt: skip

    def db_up() -> bool:
        with socket.create_connection(("127.0.0.1", db_port), timeout=1):
            return True

    c._wait_for("MariaDB", db_up, 60, ("mariadbd",))
    conf = c.root / "etc" / "slurmdbd.conf"
    conf.write_text(
        f"AuthType=auth/munge\nAuthInfo=socket={c.root}/munge/munge.socket\nDbdHost=localhost\nDbdPort={dbd_port}\n"
        f"SlurmUser=root\nLogFile={c.root}/log/slurmdbd.log\nPidFile={c.root}/run/slurmdbd.pid\n"
        f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={db_port}\nStorageUser=root\n"
        f"StorageLoc=slurm_acct_db\n"
    )
    conf.chmod(0o600)
    c._start("slurmdbd", ["slurmdbd", "-D", "-s"])  # -s: SLURM_CONF's folder holds slurmdbd.conf

    def dbd_up() -> bool:
        return c.run("sacctmgr", "-n", "list", "cluster", check=False, timeout=20).returncode == 0

    c._wait_for("slurmdbd", dbd_up, 90, ("mariadbd", "slurmdbd"))
    c.run("sacctmgr", "-i", "add", "cluster", CLUSTER, check=False)
    c.run("sacctmgr", "-i", "add", "account", ACCOUNT, f"cluster={CLUSTER}")
    c.run("sacctmgr", "-i", "add", "user", "root", f"account={ACCOUNT}", f"cluster={CLUSTER}")


def start(accounting: bool = False, root: Path | None = None) -> Cluster:
    """A running cluster (see the module note); raises RuntimeError with the daemons' logs if it
    does not come up, after stopping what did."""
    why = missing_accounting() if accounting else missing()
    if why:
        raise RuntimeError(why)
    root = Path(root or tempfile.mkdtemp(prefix="perflab-slurm-"))
    c = Cluster(root, accounting)
    try:
        for sub in ("etc", "state", "spool/n1", "spool/n2", "log", "run"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        ctld, n1, n2, dbd, db = free_ports(5)
        (root / "etc" / "slurm.conf").write_text(_slurm_conf(c, ctld, (n1, n2), dbd if accounting else None))
        if accounting:
            fake = [root / "dev" / f"fake-gpu{i}" for i in range(FAKE_GPUS)]
            fake[0].parent.mkdir()
            for f in fake:  # SLURM wants a character device: copies of /dev/null's (1, 3)
                os.mknod(f, stat.S_IFCHR | 0o666, os.makedev(1, 3))
            (root / "etc" / "gres.conf").write_text(
                f"NodeName=n[1-2] Name=gpu File={fake[0].parent}/fake-gpu[0-{FAKE_GPUS - 1}]\n"
            )
        # the watcher names the folder on its command line, so stop() ends it with the job steps
        c.watcher = subprocess.Popen([sys.executable, __file__, "--reap", str(os.getpid()), str(root)],
                                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)  # fmt: skip
        _start_munge(c)
        if accounting:
            _start_accounting(c, dbd, db)
        c._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(c.conf)])
        for n in ("n1", "n2"):
            c._start(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(c.conf)])
        c._wait_for("both nodes idle", lambda: c.idle_nodes() == ["n1", "n2"], 90, tuple(c.procs))
    except BaseException:
        logs = "\n".join(c.tail(n) for n in c.procs)
        c.stop()
        raise RuntimeError(f"the SLURM test cluster did not come up:\n{logs}") from None
    return c


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reap"]:
        reap_when_gone(int(sys.argv[2]), Path(sys.argv[3]))
        sys.exit(0)
    cl = start(accounting="--accounting" in sys.argv)
    print(f"export SLURM_CONF={cl.conf}")
    try:
        input("cluster up; Enter stops it\n")
    finally:
        cl.stop()

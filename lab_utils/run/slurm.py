"""A SLURM site as its commands show it: checked before anything is submitted, and asked how each job ended.

* :meth:`Site.probe` reads, once, what the site has: its partitions (``scontrol show partition``:
  state, MaxTime, MaxNodes, allowed accounts), their nodes' CPUs, memory and GPUs (``sinfo``'s
  GRES), whether it keeps accounting (``scontrol show config``: ``AccountingStorageType``) and,
  when it does, the accounts this user may charge (``sacctmgr show assoc``).
* :func:`check_options` refuses, naming the option, what the site would refuse or leave pending
  for ever: an unknown or inactive partition, an account the user has no association with, more
  GPUs or CPUs than a node has, a time limit past the partition's MaxTime, more nodes than the
  partition has or allows.
* :class:`Watch` follows submitted jobs with what every site has: one ``squeue --states=all`` for
  all of them (slurmctld keeps an ended job for MinJobAge, 300 s by default), ``scontrol show job``
  for how one ended, and ``sacct`` only where the site keeps accounting and slurmctld has already
  forgotten the job.  A job that has left the queue is never waited on: :func:`describe` turns its
  state into the reason a report shows (``TIMEOUT``, ``CANCELLED by 0``, a task killed by SIGKILL...).
  Nor is a job SLURM keeps pending for a reason no waiting resolves (a QOS or association limit the
  site did not enforce at submission: :data:`NEVER_STARTS`): it is cancelled and its row says why.
"""

from __future__ import annotations

import getpass
import re
import signal
import subprocess
from dataclasses import dataclass, field

from ..core.config import ConfigError

#: job states after which the job no longer runs (``squeue --states``' names)
TERMINAL = frozenset(
    "BOOT_FAIL CANCELLED COMPLETED DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY PREEMPTED REVOKED SPECIAL_EXIT TIMEOUT"
    "".split()
)
#: terminal states that say the job was stopped from outside rather than failing
CANCELLED = frozenset({"CANCELLED", "PREEMPTED", "DEADLINE", "REVOKED"})
TIMEOUT = "TIMEOUT"
RUNS = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED"})
GONE = "GONE"  # slurmctld no longer knows the job and the site keeps no accounting
#: reasons a job stays PENDING that no waiting resolves: a limit of its partition, QOS or association
#: it exceeds as submitted (sites that do not enforce limits at submission accept such a job)
NEVER_STARTS = frozenset(
    "PartitionNodeLimit PartitionTimeLimit BadConstraints InvalidAccount InvalidQOS AccountNotAllowed "
    "QOSMaxWallDurationPerJobLimit QOSMaxCpuPerJobLimit QOSMaxNodePerJobLimit QOSMaxGRESPerJob "
    "QOSMaxMemoryPerJob QOSMinCpuNotSatisfied QOSMinGRES AssocMaxWallDurationPerJobLimit "
    "AssocMaxCpuPerJobLimit AssocMaxNodePerJobLimit AssocMaxGRESPerJob AssocMaxMemPerJob "
    "DependencyNeverSatisfied".split()
)
_KV = re.compile(r"(\S+?)=(\S*)")


class SlurmError(RuntimeError):
    """A SLURM command failed (its stderr in the message)."""


def run(cmd: list[str], timeout: float = 30.0) -> str:
    """A SLURM client command's stdout; :class:`SlurmError` with its stderr when it fails."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SlurmError(f"{' '.join(cmd)}: {e}") from None
    if p.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)} (exit {p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def minutes(text: str) -> float | None:
    """A SLURM duration (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) in minutes; None for
    UNLIMITED / INFINITE / NONE."""
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE", "NONE", "N/A", ""):
        return None
    days, _, rest = t.rpartition("-")
    parts = [int(x) for x in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
    else:
        h, m, s = {1: (0, parts[0], 0), 2: (0, *parts), 3: tuple(parts)}[len(parts)]
    return (int(days or 0) * 24 + h) * 60 + m + s / 60


def gres_gpus(gres: str) -> int:
    """GPUs in a node's GRES as sinfo shows it (``gpu:8``, ``gpu:h100:4(S:0-1)``, ``(null)``)."""
    total = 0
    for part in re.sub(r"\([^)]*\)", "", gres or "").split(","):
        bits = part.strip().split(":")
        if bits[0] == "gpu" and len(bits) >= 2 and bits[-1].isdigit():
            total += int(bits[-1])
    return total


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    state: str
    max_time_min: float | None  # None: no limit
    default_time_min: float | None  # DefaultTime (None: the partition has none)
    max_nodes: int | None  # None: no limit
    total_nodes: int
    allow_accounts: tuple[str, ...] | None  # None: ALL
    deny_accounts: tuple[str, ...]
    node_cpus: int  # the fewest CPUs a node of the partition has
    node_mem_mb: int  # the least memory a node has
    node_gpus: int  # the most GPUs a node has (0: none)
    gres: str  # as sinfo shows it, for messages

    @property
    def node_limit(self) -> int:
        return min(self.total_nodes, self.max_nodes or self.total_nodes)


@dataclass(frozen=True)
class Site:
    partitions: dict[str, Partition]
    accounting: bool
    enforce: str = ""
    accounts: tuple[str, ...] | None = None  # this user's associations (None: no accounting to ask)
    user: str = ""

    @classmethod
    def probe(cls) -> Site:
        """The site as ``scontrol``, ``sinfo`` and (with accounting) ``sacctmgr`` show it now."""
        config = dict(
            (k.strip(), v.strip())
            for k, _, v in (ln.partition("=") for ln in run(["scontrol", "show", "config"]).splitlines())
        )
        storage = config.get("AccountingStorageType", "accounting_storage/none")
        accounting = storage not in ("", "accounting_storage/none")
        nodes: dict[str, list[tuple[int, int, int, str]]] = {}
        for ln in run(["sinfo", "-h", "-N", "-o", "%P|%N|%c|%m|%G"]).splitlines():
            part, _, cpus, mem, gres = ln.split("|")
            nodes.setdefault(part.rstrip("*"), []).append((int(cpus), int(float(mem)), gres_gpus(gres), gres))
        parts = {}
        for ln in run(["scontrol", "show", "partition", "-o"]).splitlines():
            kv = dict(_KV.findall(ln))
            if "PartitionName" not in kv:
                continue
            name = kv["PartitionName"]
            ns = nodes.get(name) or [(0, 0, 0, "(null)")]
            allow = kv.get("AllowAccounts", "ALL")
            parts[name] = Partition(
                name=name,
                default=kv.get("Default") == "YES",
                state=kv.get("State", "UP"),
                max_time_min=minutes(kv.get("MaxTime", "UNLIMITED")),
                default_time_min=minutes(kv.get("DefaultTime", "NONE")),
                max_nodes=None if kv.get("MaxNodes", "UNLIMITED") == "UNLIMITED" else int(kv["MaxNodes"]),
                total_nodes=int(kv.get("TotalNodes", len(ns))),
                allow_accounts=None if allow == "ALL" else tuple(allow.split(",")),
                deny_accounts=tuple(a for a in kv.get("DenyAccounts", "").split(",") if a and a != "(null)"),
                node_cpus=min(n[0] for n in ns),
                node_mem_mb=min(n[1] for n in ns),
                node_gpus=max(n[2] for n in ns),
                gres=",".join(sorted({n[3] for n in ns})),
            )
        user = getpass.getuser()
        accounts = None
        if accounting:
            out = run(["sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "format=account"])
            accounts = tuple(sorted({ln.strip() for ln in out.splitlines() if ln.strip()}))
        return cls(parts, accounting, config.get("AccountingStorageEnforce", ""), accounts, user)

    def partition(self, name: str | None) -> Partition:
        """The partition named, or the site's default one; ConfigError naming ``--partition`` otherwise."""
        names = ", ".join(sorted(self.partitions)) or "none"
        if name is None:
            default = [p for p in self.partitions.values() if p.default]
            if not default:
                raise ConfigError("--partition", None, f"a partition: this site has no default one (sinfo: {names})")
            return default[0]
        if name not in self.partitions:
            raise ConfigError("--partition", name, f"one of {names} (the partitions sinfo lists here)")
        return self.partitions[name]


def check_options(opts, site: Site, *, gpus: int, nodes: int, cpus: int | None, mem_gb: float | None) -> Partition:
    """Refuse what ``site`` would refuse or leave pending for ever (see the module note), naming the
    option; ``gpus``/``nodes``: the most any job of the run asks for.  Returns the partition."""
    p = site.partition(opts.partition)
    if p.state.upper() in ("INACTIVE", "DOWN", "DRAIN"):
        raise ConfigError("--partition", p.name, f"a partition that is UP: {p.name} is {p.state}")
    acct = opts.account
    refused = acct in p.deny_accounts or (p.allow_accounts is not None and acct not in p.allow_accounts)
    if acct is not None and refused:
        allowed = ", ".join(p.allow_accounts or ()) or "none"
        raise ConfigError("--account", acct, f"an account partition {p.name} allows: {allowed}")
    if acct is not None and site.accounts is not None and "associations" in site.enforce and acct not in site.accounts:
        mine = ", ".join(site.accounts) or "none"
        raise ConfigError("--account", acct, f"one of {site.user}'s accounts: {mine} (sacctmgr show assoc)")
    if p.max_time_min is not None and opts.timeout_min > p.max_time_min:
        raise ConfigError("--time-limit", opts.timeout_min, f"at most {p.max_time_min:g} minutes ({p.name}'s MaxTime)")
    if gpus > p.node_gpus:
        have = f"{p.node_gpus} per node" if p.node_gpus else "none"
        why = f"at most {p.node_gpus}: {p.name}'s nodes have {have} (GRES {p.gres})"
        raise ConfigError("--gpus-per-node", gpus, why)
    if nodes > p.node_limit:
        why = f"MaxNodes={p.max_nodes}" if p.max_nodes and p.max_nodes < p.total_nodes else f"{p.total_nodes} nodes"
        raise ConfigError("--nodes", nodes, f"at most {p.node_limit} (partition {p.name} has {why})")
    if cpus is not None and cpus > p.node_cpus:
        raise ConfigError("cpus_per_task", cpus, f"at most {p.node_cpus} (the CPUs of a node of {p.name})")
    if mem_gb is not None and mem_gb * 1024 > p.node_mem_mb > 0:
        why = f"at most {p.node_mem_mb / 1024:g} (the memory in GB of a node of {p.name})"
        raise ConfigError("mem_gb", mem_gb, why)
    return p


# ----------------------------------------------------------------------------- following jobs
@dataclass
class JobState:
    """What SLURM says of one job: ``state`` as squeue names it (or :data:`GONE`)."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""
    exit_code: str = ""
    restarts: int = 0
    ran: bool = False  # seen running (or SLURM says it started)
    source: str = "squeue"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL or self.state == GONE

    @property
    def never_starts(self) -> bool:
        """PENDING for a reason no waiting resolves (:data:`NEVER_STARTS`)."""
        return self.state == "PENDING" and self.reason in NEVER_STARTS


def _base(job_id: str) -> str:
    return job_id.split("_")[0]


@dataclass
class Watch:
    """Follows jobs by id (see the module note); ``accounting``: whether sacct can be asked."""

    accounting: bool
    seen: dict[str, JobState] = field(default_factory=dict)

    def poll(self, ids: list[str]) -> dict[str, JobState]:
        """The state of every job in ``ids`` now: one squeue for all, then scontrol / sacct for
        those that ended (their exit code and reason) or that slurmctld no longer knows."""
        if not ids:
            return {}
        try:
            out = run(["squeue", "-h", "-r", "--states=all", "-j", ",".join(sorted({_base(i) for i in ids})),
                       "-o", "%i|%T|%r|%N"])  # fmt: skip
        except SlurmError as e:
            if "Invalid job id" not in str(e):
                raise
            out = ""
        now: dict[str, tuple[str, str, str]] = {}
        for ln in out.splitlines():
            jid, state, reason, nodes = (ln.split("|") + ["", "", ""])[:4]
            now[jid.strip()] = (state.strip(), reason.strip(), nodes.strip())
        got = {}
        for jid in ids:
            prev = self.seen.get(jid)
            if jid in now:
                state, reason, nodes = now[jid]
                js = JobState(jid, state, reason, nodes or (prev.nodes if prev else ""))
                js.ran = (prev.ran if prev else False) or state in ("RUNNING", "COMPLETING") or bool(nodes)
                js.restarts = prev.restarts if prev else 0
                if prev and prev.state in RUNS and state in ("PENDING", "REQUEUED", "REQUEUE_HOLD"):
                    js.restarts += 1  # requeued (a preemption): it will run again
                if js.terminal:
                    js = self._details(js)
            else:
                js = self._forgotten(jid, prev)
            self.seen[jid] = js
            got[jid] = js
        return got

    def settle(self, jid: str, js: JobState | None) -> JobState:
        """A job that has written its result: its restarts and nodes as ``scontrol show job`` gives
        them now (a requeue that came and went between two polls is counted all the same)."""
        out = self._details(js or JobState(jid, "RUNNING"))
        self.seen[jid] = out
        return out

    def _details(self, js: JobState) -> JobState:
        """Exit code, reason and restarts of an ended job (``scontrol show job``)."""
        try:
            kv = dict(_KV.findall(run(["scontrol", "show", "job", "-o", js.job_id])))
        except SlurmError:
            return js
        js.exit_code = kv.get("ExitCode", js.exit_code)
        js.reason = kv.get("Reason", js.reason)
        js.restarts = max(js.restarts, int(kv.get("Restarts", 0) or 0))
        js.ran = js.ran or kv.get("RunTime", "00:00:00") not in ("00:00:00", "0:00")
        js.nodes = js.nodes or kv.get("NodeList", "").replace("(null)", "")
        js.source = "scontrol"
        return js

    def _forgotten(self, jid: str, prev: JobState | None) -> JobState:
        """A job squeue no longer lists: sacct where the site keeps accounting, else :data:`GONE`."""
        if self.accounting:
            try:
                out = run(["sacct", "-n", "-P", "-X", "-j", jid, "-o", "JobID,State,ExitCode,Reason,NodeList,Elapsed"])
            except SlurmError:
                out = ""
            for ln in out.splitlines():
                f = ln.split("|")
                if len(f) >= 6 and f[0] == jid:
                    state = f[1].split()[0] if f[1] else "UNKNOWN"
                    ran = f[5] not in ("00:00:00", "") or (prev.ran if prev else False)
                    return JobState(jid, state, f[3], f[4].replace("None assigned", ""), f[2], ran=ran, source="sacct")
            if prev is None:  # just submitted: not yet in the accounting either
                return JobState(jid, "PENDING", "submitted", source="sacct")
        if prev is None:
            return JobState(jid, "PENDING", "submitted", source="squeue")
        return JobState(jid, GONE, prev.reason, prev.nodes, ran=prev.ran, restarts=prev.restarts, source="gone")


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def exit_meaning(exit_code: str) -> str:
    """SLURM's ``ExitCode=code:signal`` in words ("" when it says nothing beyond success)."""
    code, _, sig = (exit_code or "0:0").partition(":")
    code_i, sig_i = int(code or 0), int(sig or 0)
    if not sig_i and code_i > 128:
        sig_i, code_i = code_i - 128, 0
    if sig_i == signal.SIGKILL:
        return "a task was killed by SIGKILL (the OOM killer's way, or kill -9)"
    if sig_i:
        return f"a task was ended by {_signal_name(sig_i)}"
    return f"exit code {code_i}" if code_i else ""


def outcome_state(js: JobState) -> str:
    """The :class:`~.executors.Outcome` state of a job that ended without a result."""
    if js.state == TIMEOUT:
        return "timed out"
    if js.state in CANCELLED:
        return "cancelled"
    return "failed"


def describe(js: JobState, timeout_min: float | None = None) -> str:
    """One line: what SLURM says became of a job that left no result."""
    where = f" on {js.nodes}" if js.nodes else ""
    again = f", requeued {js.restarts}x" if js.restarts else ""
    said = f"SLURM: {js.state}" + (f", {js.reason}" if js.reason and js.reason != "None" else "")
    said += f", exit code {js.exit_code}" if js.exit_code and js.exit_code != "0:0" else ""
    if js.state == TIMEOUT:
        limit = f" of {timeout_min:g} min" if timeout_min else ""
        return f"SLURM ended job {js.job_id}{where} at its time limit{limit} ({said}{again})"
    if js.state in CANCELLED:
        when = "while it ran" if js.ran else "before it started"
        return f"job {js.job_id} was {js.state.lower()} {when}{where} ({said}{again})"
    if js.never_starts:
        return (
            f"job {js.job_id} cannot start as submitted: SLURM keeps it PENDING ({js.reason}: a limit of its "
            f"partition, QOS or association it exceeds), so perflab cancelled it"
        )
    if js.state == GONE:
        return (
            f"job {js.job_id}{where} left the queue without a result; slurmctld no longer knows it and this site "
            f"keeps no accounting (sacct) to say how it ended"
        )
    meaning = exit_meaning(js.exit_code)
    return f"job {js.job_id} ended {js.state}{where}" + (f": {meaning}" if meaning else "") + f" ({said}{again})"

"""What perflab reads from a SLURM site and how it words a job's end, on fixed command outputs (no cluster;
tests/jobs/test_slurm.py runs the same against a real one): durations, GRES, partitions at each limit,
accounts, the states squeue / scontrol / sacct give, and exit codes in words."""

import pytest

from lab_utils.core.config import ConfigError
from lab_utils.run import slurm
from lab_utils.run.cluster import ClusterOptions


def test_slurm_durations_gres_and_exit_codes_read_as_slurm_writes_them():
    assert [slurm.minutes(t) for t in ("5", "2:30", "00:10:00", "1-00:00:00", "2-12", "1-0:30")] == [
        5, 2.5, 10, 1440, 3600, 1470
    ]  # fmt: skip
    assert slurm.minutes("UNLIMITED") is None and slurm.minutes("NONE") is None
    assert slurm.gres_gpus("gpu:h100:4(S:0-1),gpu:a100:2") == 6 and slurm.gres_gpus("gpu:8") == 8
    assert slurm.gres_gpus("(null)") == 0 and slurm.gres_gpus("shard:8,mps:100") == 0
    kill = "a task was killed by SIGKILL (the OOM killer's way, or kill -9)"
    assert slurm.exit_meaning("137:0") == kill == slurm.exit_meaning("0:9")  # srun's 128+9, or the signal field
    assert slurm.exit_meaning("0:15") == "a task was ended by SIGTERM" and slurm.exit_meaning("1:0") == "exit code 1"
    assert slurm.exit_meaning("0:0") == "" and slurm.exit_meaning("") == ""


def _js(state, **kw):
    return slurm.JobState("42", state, **kw)


def test_a_jobs_end_is_worded_from_the_state_slurm_gives():
    t = slurm.describe(_js("TIMEOUT", reason="TimeLimit", nodes="n1", exit_code="0:15", ran=True), 1)
    assert t.startswith("SLURM ended job 42 on n1 at its time limit of 1 min (SLURM: TIMEOUT, TimeLimit"), t
    assert slurm.outcome_state(_js("TIMEOUT")) == "timed out"
    pend = slurm.describe(_js("CANCELLED", reason="Resources"))
    assert pend.startswith("job 42 was cancelled before it started (SLURM: CANCELLED, Resources"), pend
    ran = slurm.describe(_js("CANCELLED", nodes="n2", ran=True, restarts=1))
    assert ran.startswith("job 42 was cancelled while it ran on n2") and "requeued 1x" in ran, ran
    assert slurm.outcome_state(_js("PREEMPTED")) == "cancelled" == slurm.outcome_state(_js("CANCELLED"))
    oom = slurm.describe(_js("OUT_OF_MEMORY", exit_code="0:9", nodes="n1"))
    assert oom.startswith("job 42 ended OUT_OF_MEMORY on n1: a task was killed by SIGKILL"), oom
    assert slurm.outcome_state(_js("OUT_OF_MEMORY")) == "failed" == slurm.outcome_state(_js("NODE_FAIL"))
    gone = slurm.describe(_js(slurm.GONE))
    assert "left the queue without a result" in gone and "keeps no accounting" in gone
    assert _js(slurm.GONE).terminal and _js("COMPLETED").terminal and not _js("PENDING").terminal
    assert not _js("REQUEUED").terminal and not _js("COMPLETING").terminal


def _part(**kw):
    base = dict(name="gpu", default=True, state="UP", max_time_min=120.0, default_time_min=None, max_nodes=None,
                total_nodes=4, allow_accounts=None, deny_accounts=(), node_cpus=64, node_mem_mb=512000,
                node_gpus=8, gres="gpu:h100:8(S:0-1)")  # fmt: skip
    return slurm.Partition(**{**base, **kw})


def _check(part, accounting=False, accounts=None, *, gpus=1, nodes=1, cpus=None, mem=None, **opts):
    site = slurm.Site({part.name: part}, accounting, "associations" if accounting else "", accounts, "ana")
    o = ClusterOptions(executor="slurm", partition=part.name, timeout_min=opts.pop("timeout_min", 60), **opts)
    return slurm.check_options(o, site, gpus=gpus, nodes=nodes, cpus=cpus, mem_gb=mem)


def test_options_are_checked_against_each_partition_limit_at_its_boundary():
    p = _part()
    assert _check(p, timeout_min=120, gpus=8, nodes=4, cpus=64, mem=500) is p  # every limit itself is allowed
    for kw, msg in [
        (dict(timeout_min=121), "'--time-limit' = 121 .* at most 120 minutes \\(gpu's MaxTime\\)"),
        (dict(gpus=9), "'--gpus-per-node' = 9 .* at most 8: gpu's nodes have 8 per node \\(GRES gpu:h100:8"),
        (dict(nodes=5), "'--nodes' = 5 .* at most 4 \\(partition gpu has 4 nodes\\)"),
        (dict(cpus=65), "'cpus_per_task' = 65 .* at most 64"),
        (dict(mem=501), "'mem_gb' = 501 .* at most 500"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            _check(p, **kw)
    with pytest.raises(ConfigError, match="'--nodes' = 3 .* at most 2 \\(partition gpu has MaxNodes=2\\)"):
        _check(_part(max_nodes=2), nodes=3)
    with pytest.raises(ConfigError, match="'--gpus-per-node' = 1 .* at most 0: cpu's nodes have none"):
        _check(_part(name="cpu", node_gpus=0, gres="(null)"), gpus=1)
    with pytest.raises(ConfigError, match="'--partition' = 'gpu' .* a partition that is UP: gpu is DOWN"):
        _check(_part(state="DOWN"))


def test_accounts_are_checked_where_the_site_can_say_which_are_allowed():
    with pytest.raises(ConfigError, match="'--account' = 'x' .* one of ana's accounts: a1, a2"):
        _check(_part(), True, ("a1", "a2"), account="x")
    assert _check(_part(), True, ("a1", "a2"), account="a2")
    assert _check(_part(), account="anything")  # no accounting and no AllowAccounts: SLURM takes any name
    with pytest.raises(ConfigError, match="'--account' = 'x' .* an account partition gpu allows: a1"):
        _check(_part(allow_accounts=("a1",)), account="x")
    with pytest.raises(ConfigError, match="'--account' = 'bad'"):
        _check(_part(deny_accounts=("bad",)), account="bad")


def test_the_default_partition_is_used_when_none_is_named():
    site = slurm.Site({"a": _part(name="a", default=False), "b": _part(name="b")}, False)
    assert site.partition(None).name == "b" and site.partition("a").name == "a"
    with pytest.raises(ConfigError, match="'--partition' = 'c' .* one of a, b"):
        site.partition("c")
    with pytest.raises(ConfigError, match="no default one"):
        slurm.Site({"a": _part(name="a", default=False)}, False).partition(None)


def _fake_site(monkeypatch, squeue: str, sacct: str) -> list[list[str]]:
    calls: list[list[str]] = []

    def run(cmd, timeout=30.0):
        calls.append(cmd)
        if cmd[0] == "squeue":
            return squeue
        if cmd[0] == "sacct":
            return sacct
        raise slurm.SlurmError(f"{cmd[0]}: not asked in this test")

    monkeypatch.setattr(slurm, "run", run)
    return calls


def test_a_job_slurmctld_has_forgotten_is_asked_of_sacct_only_where_the_site_keeps_accounting(monkeypatch):
    _fake_site(monkeypatch, "", "42|CANCELLED by 0|0:15|None|n1|00:00:05\n")
    w = slurm.Watch(accounting=True)
    js = w.poll(["42"])["42"]
    assert (js.state, js.nodes, js.ran, js.source) == ("CANCELLED", "n1", True, "sacct")
    assert slurm.describe(js).startswith("job 42 was cancelled while it ran on n1")
    calls = _fake_site(monkeypatch, "42|RUNNING|None|n2\n", "")
    w = slurm.Watch(accounting=False)
    assert w.poll(["42"])["42"].state == "RUNNING"
    gone = _fake_site(monkeypatch, "", "")  # gone from squeue, and no sacct to ask: never waited on
    js = w.poll(["42"])["42"]
    assert js.state == slurm.GONE and js.terminal and js.nodes == "n2" and js.ran
    assert [c[0] for c in calls + gone] == ["squeue", "squeue"], calls + gone


def test_a_requeued_job_counts_its_restarts(monkeypatch):
    w = slurm.Watch(accounting=False)
    for state in ("PENDING", "RUNNING", "PENDING", "RUNNING"):
        _fake_site(monkeypatch, f"7|{state}|BeginTime|n1\n", "")
        js = w.poll(["7"])["7"]
    assert js.restarts == 1 and not js.terminal


def test_a_requeue_between_two_polls_is_counted_when_the_job_settles(monkeypatch):
    """Seen running twice, never pending (its preemption and restart fell between two polls): the
    job's result settles it from scontrol, whose Restarts=1 the row then says."""
    w = slurm.Watch(accounting=False)
    for _ in range(2):
        _fake_site(monkeypatch, "7|RUNNING|None|n1\n", "")
        assert w.poll(["7"])["7"].restarts == 0

    def run(cmd, timeout=30.0):
        assert cmd[:3] == ["scontrol", "show", "job"], cmd
        return "JobId=7 JobName=acc JobState=RUNNING Reason=None Restarts=1 RunTime=00:00:04 NodeList=n2\n"

    monkeypatch.setattr(slurm, "run", run)
    js = w.settle("7", w.seen["7"])
    assert (js.restarts, js.nodes, js.source) == (1, "n1", "scontrol") and w.seen["7"] is js
    assert w.settle("8", None).restarts == 1  # finished before its first poll


def test_a_job_pending_for_a_limit_it_exceeds_is_not_waited_on(monkeypatch):
    """PENDING for QOSMaxWallDurationPerJobLimit (a site that does not enforce limits at submission)
    never starts: the job says so; PENDING for Resources or a requeue's BeginTime is waited on."""
    w = slurm.Watch(accounting=False)
    _fake_site(monkeypatch, "9|PENDING|QOSMaxWallDurationPerJobLimit|\n", "")
    js = w.poll(["9"])["9"]
    assert js.never_starts and not js.terminal and slurm.outcome_state(js) == "failed"
    why = slurm.describe(js)
    assert why.startswith("job 9 cannot start as submitted: SLURM keeps it PENDING (QOSMaxWallDurationPerJobLimit"), why
    for reason in ("Resources", "Priority", "BeginTime", "ReqNodeNotAvail", "JobHeldUser"):
        assert not _js("PENDING", reason=reason).never_starts, reason
    assert not _js("RUNNING", reason="PartitionTimeLimit").never_starts


def test_a_partition_whose_nodes_report_no_memory_takes_any_mem_gb():
    """sinfo shows 0 MB for nodes whose memory SLURM does not track: no limit to check against,
    while a node that reports memory refuses a single GB more than it has."""
    assert _check(_part(node_mem_mb=0), mem=10_000) is not None
    assert _check(_part(node_mem_mb=1024), mem=1) is not None  # 1 GB is 1024 MB: exactly a node's memory
    with pytest.raises(ConfigError, match="'mem_gb' = 2 .* at most 1 "):
        _check(_part(node_mem_mb=1024), mem=2)


def test_the_partitions_node_limit_is_the_smaller_of_its_nodes_and_its_maxnodes():
    assert _part(total_nodes=4, max_nodes=None).node_limit == 4
    assert _part(total_nodes=4, max_nodes=2).node_limit == 2
    assert _part(total_nodes=4, max_nodes=16).node_limit == 4  # MaxNodes past the nodes it has


def test_a_job_just_submitted_that_squeue_does_not_list_yet_is_pending(monkeypatch):
    """Not in squeue and never seen: submitted a moment ago (squeue lags sbatch), waited on, with or
    without accounting; sacct not knowing it yet either says the same."""
    for accounting in (False, True):
        _fake_site(monkeypatch, "", "")
        js = slurm.Watch(accounting=accounting).poll(["5"])["5"]
        assert (js.state, js.reason, js.terminal) == ("PENDING", "submitted", False), accounting
    assert slurm.Watch(accounting=False).poll([]) == {}


def test_sacct_fields_land_in_their_place(monkeypatch):
    """JobID|State|ExitCode|Reason|NodeList|Elapsed: each field where the row reads it."""
    _fake_site(monkeypatch, "", "77|OUT_OF_MEMORY|0:9|OutOfMemory|n3|00:01:02\n77.batch|x|y|z|w|v\n")
    js = slurm.Watch(accounting=True).poll(["77"])["77"]
    assert (js.state, js.exit_code, js.reason, js.nodes, js.ran) == ("OUT_OF_MEMORY", "0:9", "OutOfMemory", "n3", True)
    _fake_site(monkeypatch, "", "78|CANCELLED by 0|0:0|None|None assigned|00:00:00\n")
    js = slurm.Watch(accounting=True).poll(["78"])["78"]
    assert (js.state, js.nodes, js.ran) == ("CANCELLED", "", False)


def test_a_site_is_read_from_scontrol_sinfo_and_sacctmgr(monkeypatch):
    """Fixed outputs of the four commands: each partition's limits, its nodes' fewest CPUs and least
    memory, their most GPUs, and the accounts this user has."""
    outputs = {
        ("scontrol", "show", "config"): "AccountingStorageType = accounting_storage/slurmdbd\n"
        "AccountingStorageEnforce = associations,limits\n",
        ("sinfo",): "gpu*|n1|64|512000|gpu:h100:4(S:0-1)\ngpu*|n2|32|256000.5|gpu:h100:8\ncpu|c1|16|64000|(null)\n",
        ("scontrol", "show", "partition"): "PartitionName=gpu Default=YES State=UP MaxTime=1-00:00:00 "
        "DefaultTime=00:30:00 MaxNodes=1 TotalNodes=2 AllowAccounts=a1,a2 DenyAccounts=(null)\n"
        "PartitionName=cpu State=DOWN MaxTime=UNLIMITED MaxNodes=UNLIMITED TotalNodes=1 DenyAccounts=bad\n"
        "not a partition line\n",
        ("sacctmgr",): "a2\n a1 \n\na2\n",
    }

    def run(cmd, timeout=30.0):
        for k, out in outputs.items():
            if tuple(cmd[: len(k)]) == k:
                return out
        raise AssertionError(cmd)

    monkeypatch.setattr(slurm, "run", run)
    monkeypatch.setattr(slurm.getpass, "getuser", lambda: "ana")
    site = slurm.Site.probe()
    gpu, cpu = site.partitions["gpu"], site.partitions["cpu"]
    assert (site.accounting, site.enforce, site.accounts, site.user) == (
        True, "associations,limits", ("a1", "a2"), "ana"
    )  # fmt: skip
    assert (gpu.default, gpu.state, gpu.max_time_min, gpu.default_time_min) == (True, "UP", 1440, 30)
    assert (gpu.max_nodes, gpu.total_nodes, gpu.allow_accounts, gpu.deny_accounts) == (1, 2, ("a1", "a2"), ())
    assert (gpu.node_cpus, gpu.node_mem_mb, gpu.node_gpus) == (32, 256000, 8)
    assert (cpu.default, cpu.state, cpu.max_time_min, cpu.max_nodes, cpu.allow_accounts) == (
        False, "DOWN", None, None, None
    )  # fmt: skip
    assert (cpu.deny_accounts, cpu.node_gpus, cpu.gres) == (("bad",), 0, "(null)")
    outputs[("scontrol", "show", "config")] = "AccountingStorageType = accounting_storage/none\n"
    del outputs[("sacctmgr",)]  # a site without accounting is not asked for associations
    plain = slurm.Site.probe()
    assert (plain.accounting, plain.accounts) == (False, None)


def test_exit_codes_past_128_are_a_signal_and_below_an_exit_code():
    """srun reports a task killed by signal N as exit code 128 + N."""
    assert slurm.exit_meaning("143:0") == "a task was ended by SIGTERM"  # 128 + 15
    assert slurm.exit_meaning("128:0") == "exit code 128"  # 128 itself: no signal 0
    assert slurm.exit_meaning("2:0") == "exit code 2"
    assert slurm.exit_meaning("0:2") == "a task was ended by SIGINT"


def test_a_squeue_line_short_of_fields_reads_the_missing_ones_as_empty(monkeypatch):
    """``%i|%T|%r|%N``: a line that stops after the state (a wrapper that trims empty fields) is
    the job in that state, with no reason and no nodes; an id squeue no longer accepts is no error."""
    _fake_site(monkeypatch, "7|RUNNING\n", "")
    js = slurm.Watch(accounting=False).poll(["7"])["7"]
    assert (js.state, js.reason, js.nodes, js.ran) == ("RUNNING", "", "", True)

    def invalid(cmd, timeout=30.0):
        raise slurm.SlurmError("squeue (exit 1): slurm_load_jobs error: Invalid job id specified")

    monkeypatch.setattr(slurm, "run", invalid)
    assert slurm.Watch(accounting=False).poll(["8"])["8"].state == "PENDING"  # just submitted
    monkeypatch.setattr(slurm, "run", lambda cmd, timeout=30.0: (_ for _ in ()).throw(slurm.SlurmError("down")))
    with pytest.raises(slurm.SlurmError, match="down"):
        slurm.Watch(accounting=False).poll(["8"])

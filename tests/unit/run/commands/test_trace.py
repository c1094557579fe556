"""lab_utils.run.commands.trace: the arguments of ``perflab trace PATH`` and ``perflab trace diff A B``:
the defaults the help and the README state, the types and choices each option takes, which command
owns which option, and the help text kept as written (its line breaks, the GPUs it names)."""

from __future__ import annotations

import re

import pytest

from lab_utils.core.datasheets import DATASHEET
from lab_utils.run.commands import trace as T
from lab_utils.run.executors import MAP_EXECUTORS


def refused(ap, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        ap.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_the_trace_commands_defaults_are_the_ones_its_help_and_the_readme_state():
    """The README: past --max-bars (20,000) the shortest activities are merged; the help: the
    timeline's step is written for Perfetto by default, 2 ranks read at once, 4 GB each."""
    a = T.parser().parse_args(["t.json"])
    assert (a.path, a.top, a.step, a.max_bars, a.perfetto) == ("t.json", 10, None, 20_000, "step")
    assert (a.out, a.json, a.executor, a.workers, a.mem_gb, a.gpu) == (".perflab/trace", False, "pool", 2, 4.0, None)
    assert (a.partition, a.account, a.time_limit, a.cluster_config) == (None, None, None, None)


def test_the_diffs_defaults_are_a_5_percent_threshold_40_rows_and_its_own_folder():
    """The README: a change is a difference past --threshold, default 5%."""
    a = T.parser(diff=True).parse_args(["a.json", "b.json"])
    assert (a.base, a.candidate, a.threshold, a.limit, a.allow_device_mismatch) == ("a.json", "b.json", 0.05, 40, False)
    assert (a.out, a.json, a.executor, a.workers, a.mem_gb, a.gpu) == (
        ".perflab/trace-diff",
        False,
        "pool",
        2,
        4.0,
        None,
    )
    assert T.parser(diff=True).parse_args(["a", "b", "--allow-device-mismatch", "--json"]).allow_device_mismatch


@pytest.mark.parametrize("diff", [False, True])
def test_every_default_the_help_names_is_the_default_parsed(diff):
    """Each "(default N)" / "(default: X)" of an option's help against what an empty command line parses."""
    ap = T.parser(diff)
    a = ap.parse_args(["a", "b"] if diff else ["a"])
    said = {}
    for act in ap._actions:
        m = re.search(r"\(default:? ([^)]+)\)", act.help or "")
        if m and act.dest not in ("partition",):  # the site's default partition: resolved later, not here
            said[act.dest] = m.group(1)
    assert {"workers", "mem_gb", "out"} <= set(said) and (diff or {"max_bars", "step"} <= set(said))
    for dest, text in said.items():
        got = getattr(a, dest)
        if isinstance(got, int | float) and text[0].isdigit():
            assert got == float(text.replace(",", "")), dest
        elif dest == "step":
            assert got is None and "median-duration step" in text
        else:
            assert got == text, dest


def test_numbers_are_parsed_as_their_types():
    a = T.parser().parse_args(["t", "--top", "3", "--step", "4", "--max-bars", "7", "--workers", "5",
                               "--mem-gb", "2.5", "--time-limit", "9"])  # fmt: skip
    assert (a.top, a.step, a.max_bars, a.workers, a.mem_gb, a.time_limit) == (3, 4, 7, 5, 2.5, 9)
    assert all(type(v) is int for v in (a.top, a.step, a.max_bars, a.workers, a.time_limit)) and type(a.mem_gb) is float
    d = T.parser(diff=True).parse_args(["a", "b", "--threshold", "0.1", "--limit", "6", "--mem-gb", "8"])
    assert (d.threshold, d.limit, d.mem_gb) == (0.1, 6, 8.0) and type(d.limit) is int


def test_the_slurm_placement_and_the_gpu_are_taken_as_given():
    args = ["--executor", "slurm", "--partition", "gpu", "--account", "me", "--cluster-config", "s.yaml",
            "--gpu", "H100 SXM5", "--out", "o", "--json"]  # fmt: skip
    for ap, pos in ((T.parser(), ["t"]), (T.parser(diff=True), ["a", "b"])):
        a = ap.parse_args(pos + args)
        assert (a.executor, a.partition, a.account, a.cluster_config, a.gpu, a.out, a.json) == (
            "slurm",
            "gpu",
            "me",
            "s.yaml",
            "H100 SXM5",
            "o",
            True,
        )


def test_the_choices_of_perfetto_and_of_the_executor(capsys):
    for mode in ("step", "all", "none"):
        assert T.parser().parse_args(["t", "--perfetto", mode]).perfetto == mode
    assert "--perfetto" in refused(T.parser(), ["t", "--perfetto", "every"], capsys)
    for ex in MAP_EXECUTORS:
        assert T.parser(diff=True).parse_args(["a", "b", "--executor", ex]).executor == ex
    assert MAP_EXECUTORS[0] == "pool" and "--executor" in refused(T.parser(), ["t", "--executor", "thread"], capsys)


def test_each_command_owns_its_options_and_positionals(capsys):
    """The trace takes one path and the page's options; the diff two sides and the comparison's."""
    assert T.parser().prog == "perflab trace" and T.parser(diff=True).prog == "perflab trace diff"
    assert "--threshold" in refused(T.parser(), ["t", "--threshold", "0.1"], capsys)
    assert "--step" in refused(T.parser(diff=True), ["a", "b", "--step", "1"], capsys)
    assert "candidate" in refused(T.parser(diff=True), ["a"], capsys)
    assert "path" in refused(T.parser(), [], capsys)
    assert "unrecognized arguments: b" in refused(T.parser(), ["a", "b"], capsys)


def test_the_help_keeps_its_text_as_written_and_names_every_gpu():
    """RawDescriptionHelpFormatter: the descriptions' line breaks are kept; --gpu lists the datasheet's parts."""
    text = T.parser().format_help()
    assert T.DESCRIPTION in text and text.rstrip().endswith(T.EPILOG)
    flat = " ".join(text.split())
    assert all(p.name in flat for p in DATASHEET.values())
    diff = T.parser(diff=True).format_help()
    assert T.DIFF_DESCRIPTION in diff and T.EPILOG not in diff
    assert "Exit 0 (no\nregression), 1 (regression), 2 (bad input), 3 (not comparable)." in diff

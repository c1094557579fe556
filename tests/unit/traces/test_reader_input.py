"""Bad input to lab_utils.traces and ``perflab trace``: a truncated ``.json.gz`` (a job killed while
writing), JSON that is not a trace, a folder with one corrupt rank, the same through submitit's
local executor.  Each is one ``ConfigError`` naming the file; the CLI prints one line, exits 2 and
writes nothing.  And the reader's exact number parsing, checked against Python's ``decimal``."""

from __future__ import annotations

import gzip
import json
import pickle
import random
from decimal import Decimal

import numpy as np
import pytest

from lab_utils.core.config import ConfigError
from lab_utils.run.cli import main as perflab
from lab_utils.traces import read_job, read_rank
from lab_utils.traces.numbers import numbers
from unit.run.test_trace_cli_figures import job


def _gz(path, text: str):
    with gzip.open(path, "wt") as fh:
        fh.write(text)
    return path


@pytest.fixture
def good(tmp_path):
    return job(tmp_path / "good.json", steps=3)


def truncated(tmp_path, good, name="cut.json.gz"):
    """The gzip stream of a real trace cut at 60%: no end-of-stream marker, JSON cut mid-event."""
    whole = gzip.compress(good.read_bytes())
    path = tmp_path / name
    path.write_bytes(whole[: int(len(whole) * 0.6)])
    return path


def test_config_error_survives_pickling():
    e = ConfigError("path", "/x/rank-3.json.gz", "a complete trace file")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is ConfigError and str(back) == str(e)
    assert (back.param, back.value, back.allowed) == ("path", "/x/rank-3.json.gz", "a complete trace file")


def test_a_truncated_gzip_trace_is_one_error_naming_it(tmp_path, good):
    path = truncated(tmp_path, good)
    with pytest.raises(ConfigError, match="truncated") as e:
        read_rank(path)
    assert e.value.value == str(path) and "\n" not in str(e.value)
    cut_json = tmp_path / "cut.json"  # plain JSON cut short: the same
    cut_json.write_text(good.read_text()[: len(good.read_text()) // 2])
    with pytest.raises(ConfigError, match="truncated"):
        read_rank(cut_json)


@pytest.mark.parametrize(
    "text,why",
    [
        ('{"traceEvents": []}', "traceEvents array is empty"),
        ('{"lr": 0.001, "batch_size": 32, "optimizer": "adamw"}', "no traceEvents array (its keys: lr, batch_size"),
        ('{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "py"}}]}',
         "none of its 1 events is a complete"),
        ("[]", "traceEvents array is empty"),
        ('{"traceEvents": [1, 2]}', "not"),
        ("not json at all", "not"),
    ],
)  # fmt: skip
def test_json_that_is_not_a_trace_is_refused(tmp_path, text, why):
    for path in (tmp_path / "x.json", _gz(tmp_path / "x.json.gz", text)):
        if path.suffix == ".json":
            path.write_text(text)
        with pytest.raises(ConfigError) as e:
            read_rank(path)
        assert why in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_folder_with_one_corrupt_rank_names_that_file_through_the_process_pool(tmp_path, good):
    folder = tmp_path / "job"
    folder.mkdir()
    for r in range(3):
        job(folder / f"rank-{r}.json", rank=r, world=4, steps=2)
    bad = truncated(tmp_path, good, name="job/rank-3.json.gz")
    with pytest.raises(ConfigError) as e:
        read_job(folder, workers=2)
    assert e.value.value == str(bad), str(e.value)


@pytest.mark.parametrize("executor", ["pool", pytest.param("local", marks=pytest.mark.slow)])  # local: ~60 s
def test_the_cli_refuses_a_bad_rank_in_one_line_exit_2_and_writes_nothing(tmp_path, good, capsys, executor):
    folder = tmp_path / "job"
    folder.mkdir()
    job(folder / "rank-0.json", rank=0, world=2, steps=2)
    bad = truncated(tmp_path, good, name="job/rank-1.json.gz")
    out = tmp_path / "out"
    code = perflab(["trace", str(folder), "--out", str(out), "--executor", executor, "--json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists()
    lines = [ln for ln in err if "ranks:" not in ln and "it/s" not in ln and ln.strip()]  # tqdm's progress aside
    assert len(lines) == 1 and str(bad) in lines[0] and "truncated" in lines[0], err
    assert "1 of 2 rank files failed" in lines[0] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize(
    "make",
    [
        lambda d, g: truncated(d, g),
        lambda d, g: _gz(d / "empty.json.gz", '{"traceEvents": []}'),
        lambda d, g: (d / "config.json").write_text('{"model": "flux", "steps": 10}') and d / "config.json",
    ],
    ids=["truncated", "empty", "config"],
)
def test_perflab_trace_on_a_bad_file_exits_2_in_one_line_and_writes_nothing(tmp_path, good, capsys, make):
    path = make(tmp_path, good)
    out = tmp_path / "out"
    assert perflab(["trace", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and not out.exists(), err
    assert perflab(["trace", "diff", str(good), str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and not out.exists(), err


def test_timestamps_parse_exactly_whatever_their_width(tmp_path):
    """The reader parses JSON numbers' text with numpy (one width at a time); against Python's
    decimal on random epoch timestamps in microseconds with 0-6 decimals, integers, and the
    forms numpy leaves to the slow path (a sign, an exponent)."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    texts = []
    for _ in range(2000):
        whole = rng.randrange(10**15, 2 * 10**15)
        digits = rng.choice([0, 0, 3, 3, 1, 6])
        texts.append(f"{whole}" if not digits else f"{whole}.{rng.randrange(10**digits):0{digits}d}")
    for extra in ([], ["-12.5", "1.5e3"]):
        raws = [t.encode() for t in texts + extra]
        whole, frac = numbers(raws)
        for t, w, f in zip(texts + extra, whole, frac):
            d = Decimal(t)
            assert Decimal(int(w)) + Decimal(float(f)) == pytest.approx(d, abs=Decimal("1e-9")), (seed, t)
            assert 0 <= f < 1, (seed, t)
    events = [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": f"TS{i}", "dur": 1.0,
               "args": {"correlation": i, "stream": 7}} for i in range(len(texts))]  # fmt: skip
    text = json.dumps({"traceEvents": events})
    for i, t in enumerate(texts):
        text = text.replace(f'"TS{i}"', t, 1)
    path = tmp_path / "ts.json"
    path.write_text(text)
    r = read_rank(path)
    base = min(int(Decimal(t)) for t in texts)
    want = np.array([float(Decimal(t) - base) for t in texts])
    assert r.t0_us == base and np.allclose(r.gpu["ts"].to_numpy(), want, rtol=0, atol=1e-6), seed

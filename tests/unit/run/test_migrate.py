"""One name per setting, one config built once.

* ``attention_path`` goes from the notebook to its kernel through at most 5 files and is
  checked once, with one message (a trace of the files whose code holds the value);
* each lab's parameters cell shows the choices its config checks (the same source);
* renamed parameters are accepted under their old names for one release, with a warning
  naming both, from a notebook's globals, a suite's YAML and ``--param``; stored baselines
  are migrated;
* the one tables: dtypes (core/dtypes.py), attention paths (attention/paths.py REGISTRY).
"""

from __future__ import annotations

import ast
import json
import re
import sys
import warnings
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import torch

import lab_utils.core.config as core_config
from lab_utils.core.config import ConfigError, DeprecatedParameter
from lab_utils.run.runner import notebook_config_class, notebook_parameters

ROOT = Path(__file__).resolve().parents[3]
LABS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))


# ----------------------------------------------------------------- attention_path: hops and checks
class Traced(str):
    """A parameter value whose identity the trace follows (it compares equal to the plain name);
    copies (``dataclasses.asdict``, ``copy.deepcopy``) are the same object, so a conversion
    through ``to_dict`` is followed too."""

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self


def _holds(frame, value) -> bool:
    for v in list(frame.f_locals.values()):
        if v is value:
            return True
        if isinstance(v, dict) and any(x is value for x in list(v.values())):
            return True
        if isinstance(v, (list, tuple)) and any(x is value for x in v):
            return True
    return False


def files_holding(value, fn) -> list[str]:
    """Repository files (lab_utils/, lab_kernels/) whose code holds ``value`` while ``fn`` runs, in
    first-seen order: a file whose code has it in a local variable (or in a dict / list / tuple that
    is one), and a file whose code passes it into a call (the caller of a frame that holds it on
    entry), so that a value handed on inside an expression, ``f(**{k: getattr(self, k) ...})``,
    never bound to a name there, still counts its file."""
    seen: dict[str, None] = {}
    roots = (str(ROOT / "lab_utils"), str(ROOT / "lab_kernels"))

    def add(frame):
        seen.setdefault(str(Path(frame.f_code.co_filename).relative_to(ROOT)), None)

    def local(frame, event, arg):
        if _holds(frame, value):
            add(frame)
        return local

    def call(frame, event, arg):
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename.startswith(roots) and _holds(frame, value):
            add(caller)
        return local(frame, event, arg) if frame.f_code.co_filename.startswith(roots) else None

    old = sys.gettrace()
    sys.settrace(call)
    try:
        fn()
    finally:
        sys.settrace(old)
    return list(seen)


#: The path of ``attention_path`` from a lab's parameters cell to its kernel: each file and what
#: it does with the value.  The notebook cell is hop 1.  At 08ca8a2 the same trace found 7:
#: these and studies/training_step.py (TrainConfig rebuilt by filtering to_dict) and
#: attention/attend.py (the registry looked up by name on every call).  At 18a0638, counting the
#: files that pass the value on as well, it found 6: these and model/train.py (TrainConfig's
#: ``__post_init__`` handed its model parameters to MMDiTConfig); lab 08 went through
#: studies/plan.py too (``train_config()`` rebuilt a TrainConfig from ``to_dict``).
ATTENTION_PATH_HOPS = {
    "labs/<the lab>.ipynb": "the parameters cell: attention_path = ...",
    "lab_utils/core/config.py": "LabConfig.from_params maps the flat parameters once, and LabConfig builds the "
    "configs it holds from them (built_from: TrainConfig.model); check_choice (the one check)",
    "lab_utils/model/config.py": "MMDiTConfig (built once, held as TrainConfig.model) validates it",
    "lab_utils/model/layers.py": "Seams resolves the name to its AttentionPath once, at build",
    "lab_utils/attention/paths.py": "REGISTRY: the path's kernel",
}


def _lab01_step(params):
    from lab_utils.model.train import Trainer
    from lab_utils.studies.training_step import TrainingStepLabConfig

    trainer = Trainer(TrainingStepLabConfig.from_params(params))
    try:
        trainer.step()
    finally:
        trainer.close()


def _lab08_step(params):
    from lab_utils.model.train import Trainer
    from lab_utils.studies.plan import PlanLabConfig

    trainer = Trainer(PlanLabConfig.from_params(params).train)  # the step the plan measures first
    try:
        trainer.step()
    finally:
        trainer.close()


@pytest.mark.parametrize("lab, step", [("01_training_step", _lab01_step), ("08_plan", _lab08_step)])
def test_attention_path_reaches_its_kernel_in_at_most_5_files(lab, step, monkeypatch):
    value = Traced("math")
    defaults = notebook_parameters(ROOT / f"labs/{lab}.ipynb")
    params = {**defaults, "attention_path": value, "device": "cpu", "encoders": "precomputed", "num_samples": 2}
    params.update(buckets=[[64, 64]], batch_size=2, ckpt_every=0, num_workers=0)

    counts = {"sdpa_math": 0}
    real = torch.nn.functional.scaled_dot_product_attention

    def counting(*a, **k):
        counts["sdpa_math"] += 1
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    files = ["labs/<the lab>.ipynb", *files_holding(value, lambda: step(params))]
    print(f"attention_path passes through (lab {lab}):", files)
    assert counts["sdpa_math"] > 0  # the math path's kernel ran (it is SDPA's math backend)
    assert set(files) <= set(ATTENTION_PATH_HOPS), set(files) - set(ATTENTION_PATH_HOPS)
    assert len(files) <= 5
    assert files[-1] == "lab_utils/attention/paths.py"


def test_the_hop_trace_counts_a_file_that_only_passes_the_value_on():
    """A file whose code hands the value on inside an expression, never binding it to a name
    (``build(**{p: getattr(self, p) ...})``, as TrainConfig's ``__post_init__`` handed
    attention_path to MMDiTConfig before ``built_from``), is a hop too."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Holder(core_config.LabConfig):
        attention_path: str = "sdpa"
        held: tuple = core_config.built_from(lambda attention_path: (attention_path,), ("attention_path",))

    value = Traced("sdpa")
    h = None

    def build():
        nonlocal h
        h = Holder(attention_path=value)

    # LabConfig.__post_init__ (core/config.py) binds no name to the value: only its passing it on counts it
    assert files_holding(value, build) == ["lab_utils/core/config.py"]
    assert h.held[0] is value and "held" not in h.to_dict()


def test_attention_path_is_checked_once_with_one_message(monkeypatch):
    from lab_utils.model import MMDiTConfig
    from lab_utils.model.train import TrainConfig
    from lab_utils.studies.training_step import TrainingStepLabConfig

    checks = []
    real = core_config.check_choice

    def counting(param, value, allowed):
        if param == "attention_path":
            checks.append(value)
        return real(param, value, allowed)

    import lab_utils.model.config as model_config

    monkeypatch.setattr(model_config, "check_choice", counting)
    defaults = notebook_parameters(ROOT / "labs/01_training_step.ipynb")
    cfg = TrainingStepLabConfig.from_params({**defaults, "attention_path": "math", "device": "cpu"})
    assert checks == ["math"] and cfg.model.attention_path == "math"
    assert cfg.model is cfg.model_config()  # built once, held
    messages = set()
    for build in (
        lambda: TrainingStepLabConfig.from_params({**defaults, "attention_path": "fast", "device": "cpu"}),
        lambda: TrainConfig(attention_path="fast"),
        lambda: MMDiTConfig.from_preset("tiny", attention_path="fast"),
    ):
        checks.clear()
        with pytest.raises(ConfigError) as e:
            build()
        assert checks == ["fast"]  # raised by the one check, once
        messages.add(str(e.value))
    (msg,) = messages
    assert msg.startswith("parameter 'attention_path' = 'fast' is not allowed: expected one of 'reference', 'sdpa'")


CHECKS = ("check_choice", "check_choices", "check_int", "check_float", "check_int_list", "check_bool")


def count_checks(monkeypatch) -> list[str]:
    """The parameter names every ``core.config`` check is called with from now on (each module
    that imported a check by name gets the counting one)."""
    calls: list[str] = []
    for name in CHECKS:
        real = getattr(core_config, name)

        def counting(param, *a, _real=real, **k):
            calls.append(param)
            return _real(param, *a, **k)

        for mod in [m for n, m in list(sys.modules.items()) if n.startswith("lab_utils") and m is not None]:
            if getattr(mod, name, None) is real:
                monkeypatch.setattr(mod, name, counting)
    return calls


def _lab01(params, calls):
    from lab_utils.studies.training_step import TrainingStepLabConfig

    cfg = TrainingStepLabConfig.from_params(params)
    assert cfg.model_config() is cfg.model_config()


def _lab05(params, calls):
    from lab_utils.studies.memory import MemoryLabConfig

    cfg = MemoryLabConfig.from_params(params)
    assert cfg.model.preset == cfg.preset


def _lab08(params, calls):
    from lab_utils.studies import page
    from lab_utils.studies import plan as study

    cfg = study.PlanLabConfig.from_params(params)
    n = len(calls)
    step = page.load(cfg)  # the step, resolved once from the lab's config: its trainer and data
    del calls[n:]  # loader check their own arguments, as they do for any caller (not the config's checks)
    study.lever_table(cfg, step), study.lever_table(cfg, step)  # the step's config is used, never rebuilt
    assert cfg.train is cfg.train and cfg.train.model.attention_path == params.get("attention_path", "sdpa")


@pytest.mark.parametrize("lab, build", [("01_training_step", _lab01), ("05_memory", _lab05), ("08_plan", _lab08)])
def test_each_value_is_checked_once_when_a_lab_config_is_built_and_used(lab, build, monkeypatch):
    """A lab's config holds the configs it is made of (the step's TrainConfig, the model's
    MMDiTConfig), built once: no parameter goes through a check twice (lab 08 rebuilt its
    TrainConfig from ``to_dict`` each time the plan used it, so every step parameter was checked
    again, attention_path by MMDiTConfig a second time)."""
    import collections

    import lab_utils.studies.memory  # noqa: F401  (imported before the checks are counted)
    import lab_utils.studies.plan  # noqa: F401
    import lab_utils.studies.training_step  # noqa: F401

    params = {**notebook_parameters(ROOT / f"labs/{lab}.ipynb"), "device": "cpu"}
    if lab != "05_memory":
        params["attention_path"] = "math"
    calls = count_checks(monkeypatch)
    build(params, calls)
    twice = {p: n for p, n in collections.Counter(calls).items() if n > 1}
    assert calls and not twice, f"{lab}: checked more than once: {twice}"
    if lab != "05_memory":
        assert calls.count("attention_path") == 1


# ------------------------------------------------------------------ parameters cells vs checks
def _cell(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    return next(c.source for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", []))


def shown_choices(source: str) -> dict[str, tuple[list[str], bool]]:
    """{parameter: (the quoted choices its comment shows, whether the list ends with '...')} for
    every assignment whose comment (inline, or the comment lines just above) lists '|' choices."""
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.Assign) or not isinstance(node.targets[0], ast.Name):
            continue
        comment = lines[node.lineno - 1].partition("#")[2] if "#" in lines[node.lineno - 1] else ""
        i = node.lineno - 2
        while i >= 0 and lines[i].lstrip().startswith("#"):
            comment = lines[i].lstrip()[1:] + " " + comment
            i -= 1
        if "|" in comment:
            out[node.targets[0].id] = (re.findall(r'"([^"]+)"', comment), comment.rstrip().endswith("..."))
    return out


def checked_choices(cls, defaults: dict, name: str) -> list[str]:
    """The choices the config's check allows for ``name``: read from the ConfigError it raises
    for a value no lab allows (a list parameter gets a list holding it)."""
    bogus = "__not_a_choice__"
    bad = [bogus] if isinstance(defaults[name], list) else bogus
    with pytest.raises(ConfigError) as e:
        cls.from_params({**defaults, name: bad})
    assert e.value.param == name, f"{name}: the check that fired is {e.value.param!r}'s"
    return [c for c in re.findall(r"'([^']+)'", e.value.allowed) if c != bogus]


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_parameters_cell_shows_the_choices_its_config_checks(path):
    cls = notebook_config_class(path)
    if cls is None:
        pytest.skip("no config")
    defaults = notebook_parameters(path)
    shown = shown_choices(_cell(path))
    for name, (choices, partial) in shown.items():
        if name == "device":  # "cuda" is refused where no GPU is visible: the choices hold, not each value
            continue
        checked = checked_choices(cls, defaults, name)
        if partial:
            assert set(choices) <= set(checked), (name, set(choices) - set(checked))
        else:
            assert sorted(choices) == sorted(checked), f"{path.stem}: {name} shows {choices}, checks {checked}"


def test_every_activation_checkpoint_parameter_shows_every_policy():
    from lab_utils.model import ACTIVATION_CHECKPOINTS

    found = {}
    for path in LABS:
        for name, (choices, partial) in shown_choices(_cell(path)).items():
            if name.startswith("activation_checkpoint"):
                found[path.stem] = name
                assert choices == list(ACTIVATION_CHECKPOINTS) and not partial, path.stem
    assert found == {
        "01_training_step": "activation_checkpoint",
        "05_memory": "activation_checkpoints",
        "06_distributed": "activation_checkpoint",
    }


# ------------------------------------------------------------------------- renamed parameters
RENAMES = [
    ("05_memory", "policies", "activation_checkpoints", ["none", "full"]),
    ("06_distributed", "checkpoint", "activation_checkpoint", "selective"),
]


@pytest.mark.parametrize("lab, old, new, value", RENAMES)
def test_old_name_is_accepted_with_a_warning_naming_both(lab, old, new, value):
    path = ROOT / "labs" / f"{lab}.ipynb"
    cls = notebook_config_class(path)
    assert cls.RENAMED[old] == new
    defaults = notebook_parameters(path)
    assert new in defaults and old not in defaults  # the notebook uses the new name
    # a notebook's globals after papermill injected the old name below the parameters cell
    with pytest.warns(DeprecatedParameter, match=f"'{old}' of {cls.__name__} is now '{new}'"):
        cfg = cls.from_params({**defaults, old: value})
    got = getattr(cfg, new)
    assert list(got) == list(value) if isinstance(value, list) else got == value
    assert old not in cfg.to_dict() and new in cfg.to_dict()  # records use the new name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cls.from_params(defaults)  # the new name alone: no warning


@pytest.mark.parametrize("lab, old, new, value", RENAMES)
def test_suite_yaml_and_param_accept_the_old_name(lab, old, new, value, tmp_path):
    from lab_utils.run.runner import plan
    from lab_utils.run.suites import load_suite, parse_overrides

    suite = tmp_path / "s.yaml"
    suite.write_text(
        json.dumps({"notebooks": [{"notebook": str(ROOT / "labs" / f"{lab}.ipynb"), "params": {old: value}}]})
    )
    with pytest.warns(DeprecatedParameter, match=f"'{old}'.*'{new}'"):
        (p,) = plan(load_suite(suite))
    assert p.params == {new: value} and p.resolved[new] == value and old not in p.resolved
    plain = tmp_path / "p.yaml"
    plain.write_text(json.dumps({"notebooks": [{"notebook": str(ROOT / "labs" / f"{lab}.ipynb")}]}))
    text = f"{old}={json.dumps(value)}"
    with pytest.warns(DeprecatedParameter):
        (p,) = plan(load_suite(plain), parse_overrides([text]))
    assert p.params == {new: value}
    other = ["full"] if isinstance(value, list) else "full"
    with pytest.raises(ConfigError, match="both are given"):
        plan(load_suite(plain), {old: value, new: other})


def test_stored_baselines_use_the_new_names_and_old_contexts_are_migrated():
    from lab_utils.run.compare.coverage import notebook_params
    from lab_utils.run.compare.sides import Side
    from lab_utils.run.migrate import migrate_context

    stored = json.loads((ROOT / "parameterized/baselines/cpu/context.json").read_text())
    params = {n["notebook"]: n["params"] for n in stored["notebooks"]}
    for lab, old, new, _ in RENAMES:
        assert new in params[lab] and old not in params[lab], lab
    # an old context (before the rename) is read under the new names, values kept
    old_ctx = {"notebooks": [{"notebook": "05_memory", "params": {"policies": ["none"], "seed": 0}}]}
    new_ctx, done = migrate_context(old_ctx)
    assert new_ctx["notebooks"][0]["params"] == {"activation_checkpoints": ["none"], "seed": 0}
    assert done == ["05_memory: policies -> activation_checkpoints"]
    assert migrate_context(new_ctx)[1] == []  # idempotent
    side = Side.__new__(Side)
    side.context = old_ctx
    side.rows = pd.DataFrame()
    assert notebook_params(side) == {"05_memory": {"activation_checkpoints": ["none"], "seed": 0}}


# ---------------------------------------------------------------------------------- one table
def test_one_table_per_concept():
    from lab_utils.attention import paths
    from lab_utils.core import dtypes
    from lab_utils.distributed import parallel

    assert parallel.DTYPES is dtypes.DTYPES
    assert paths.PATHS == tuple(paths.REGISTRY)
    for mod in ("lab_utils/model/config.py", "lab_utils/plan/levers.py"):
        src = (ROOT / mod).read_text()
        assert "ATTENTION_PATHS" not in src and "attention_paths.REGISTRY" in src, mod


def test_memory_lab_builds_its_model_config_once(monkeypatch):
    from lab_utils.model import MMDiTConfig
    from lab_utils.studies import memory as study

    cfg = study.MemoryLabConfig(device="cpu")
    built = []
    real = MMDiTConfig.__post_init__
    monkeypatch.setattr(MMDiTConfig, "__post_init__", lambda self: built.append(1) or real(self))
    cfg.step_shape(), cfg.step_shape()
    assert cfg.model.preset == "tiny" and built == []
    src = (ROOT / "lab_utils/studies/memory.py").read_text()
    assert "resolve_config(self.preset)" not in src and "resolve_config(cfg.preset)" not in src

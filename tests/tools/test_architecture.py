"""The package's shape holds: layers import downwards only, no cycles, no module too long,
no imports of private names across modules, no importlib strings between the project's
modules, and lab_kernels stands alone (a kernel module can be copied out on its own)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lab_kernels", "lab_utils")
MAX_LINES = 600

#: Layers, lowest first, read from the folders: a module may import from its own layer or
#: any layer below. ``lab_utils/<folder>/`` is a room; its layer is the folder's, so a new
#: module is placed by the folder it is put in, and a new folder must be given a layer here
#: and a row on docs/architecture.md.
FOLDER_LAYERS = {
    "core": 1,
    "attention": 2,
    "precision": 2,
    "traces": 2,
    "model": 3,
    "fused": 4,
    "profiling": 4,
    "stability": 4,
    "plan": 4,
    "memory": 4,
    "distributed": 4,
    "step": 3,
    "studies": 5,
    "run": 6,
}


def layer(module: str) -> int:
    parts = module.split(".")
    if parts[0] == "lab_kernels":
        return 0
    if len(parts) == 1:  # lab_utils/__init__: sets up the core (TRITON_INTERPRET, log filters)
        return 1
    if parts[1] not in FOLDER_LAYERS:
        raise AssertionError(f"{module}: lab_utils/{parts[1]} is not a known room; give it a layer in FOLDER_LAYERS")
    return FOLDER_LAYERS[parts[1]]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def resolve(mod: str, path: Path, node: ast.ImportFrom) -> list[str]:
    """Absolute names a ``from ... import`` reaches (the module, or its submodules)."""
    if node.level:
        base = mod.split(".")
        if path.name != "__init__.py":
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{a.name}" for a in node.names]


def project_imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = resolve(mod, path, node)
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n and n != mod and n.split(".")[0] in PACKAGES:
                    deps.add(n)
        graph[mod] = deps
    return graph


MODS = modules()
GRAPH = project_imports(MODS)


def test_lab_kernels_never_imports_lab_utils():
    bad = {m: sorted(d for d in deps if d.startswith("lab_utils")) for m, deps in GRAPH.items()}
    bad = {m: d for m, d in bad.items() if m.startswith("lab_kernels") and d}
    assert not bad, f"lab_kernels must stand alone; these import lab_utils: {bad}"


def test_imports_point_down_the_layers():
    up = []
    for mod, deps in GRAPH.items():
        for d in deps:
            # a package's __init__ may re-export its own submodules
            if layer(d) > layer(mod) and not d.startswith(mod + "."):
                up.append(f"{mod} (layer {layer(mod)}) imports {d} (layer {layer(d)})")
    assert not up, "imports that point up the layers:\n" + "\n".join(sorted(up))


def test_no_import_cycle():
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH.get(m, ())):
            if d.startswith(m + "."):  # a package importing its own submodule is not a cycle
                continue
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("mod", sorted(MODS))
def test_module_length(mod):
    n = len(MODS[mod].read_text().splitlines())
    assert n <= MAX_LINES, f"{MODS[mod].relative_to(ROOT)} has {n} lines (at most {MAX_LINES}): split it"


def test_no_private_names_across_modules_and_no_importlib_strings():
    bad = []
    for mod, path in MODS.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                targets = resolve(mod, path, node)
                if targets[0].split(".")[0] not in PACKAGES:
                    continue
                for a in node.names:
                    # a package's private helper module (lab_kernels._common) serves its own modules
                    own_module = f"{targets[0]}.{a.name}" in MODS and targets[0].split(".")[0] == mod.split(".")[0]
                    if a.name.startswith("_") and a.name != "__version__" and not own_module:
                        bad.append(f"{mod}: from {targets[0]} import {a.name}")
            # the suites module imports the LabConfig a notebook names in its metadata, and step.load
            # the factory a lab's ``step`` parameter names: data, not a code dependency
            loaders = ("lab_utils.run.suites", "lab_utils.step.load")
            if isinstance(node, ast.Attribute) and node.attr == "import_module" and mod not in loaders:
                call_args = [n for n in ast.walk(node) if isinstance(n, ast.Constant)]
                bad.append(f"{mod}: importlib.import_module (line {node.lineno}) {call_args}")
    assert not bad, "private names used across modules / importlib strings:\n" + "\n".join(bad)


def test_lab_utils_is_folders_only_and_every_folder_has_a_layer_and_a_row_on_the_page():
    """``ls lab_utils`` reads like docs/architecture.md: no flat modules beside ``__init__``,
    every folder is a package with a layer, and the page names every folder and module."""
    flat = sorted(p.name for p in (ROOT / "lab_utils").glob("*.py") if p.name != "__init__.py")
    assert not flat, f"flat modules in lab_utils/ (put each in the folder of its layer): {flat}"
    folders = sorted(p.name for p in (ROOT / "lab_utils").iterdir() if p.is_dir() and not p.name.startswith(("_", ".")))
    assert sorted(FOLDER_LAYERS) == folders, f"folders {folders} vs layers given {sorted(FOLDER_LAYERS)}"
    for folder in folders:
        assert (ROOT / "lab_utils" / folder / "__init__.py").exists(), f"lab_utils/{folder} is not a package"
    text = (ROOT / "docs" / "architecture.md").read_text()
    missing = [f"{f}/" for f in folders if f"`{f}/`" not in text]
    missing += [
        m.split(".")[-1]
        for m in MODS
        if m.startswith("lab_utils.")
        and m.count(".") == 2
        and MODS[m].name != "__init__.py"
        and not m.endswith(".__main__")
        and f"`{m.split('.')[-1]}`" not in text
    ]
    assert not missing, f"docs/architecture.md does not place these lab_utils folders/modules: {missing}"


MAX_FUNCTION_LINES = 100
MAX_PARAMETERS = 8  # excluding self / cls; *args and **kwargs count one each

#: Functions of lab_utils allowed over the limits, each with why.  Keys: "path:qualname".
#: An entry that no longer offends fails the test too, so the list only shrinks.
_COLUMNS = "one keyword per column of a tidy record row: a row object would only rename them"
_FACTORY = "a factory: sizes, then keyword settings with defaults (dtype, device, seed, ...)"
FUNCTION_ALLOWED = {
    "lab_utils/attention/attend.py:random_qkv": _FACTORY,
    "lab_utils/model/train.py:synthetic_batch": _FACTORY,
    "lab_utils/model/data.py:make_loader": "torch DataLoader's own keywords, one to one, plus pad_to and seed",
    "lab_utils/attention/paths.py:AttentionPath.why_not": "one keyword per field of Problem.as_check(), splatted",
    "lab_utils/core/records.py:Recorder.add": _COLUMNS,
    "lab_utils/core/records.py:Recorder.add_timing": _COLUMNS,
    "lab_utils/run/runner.py:run_suite": "one keyword per `perflab run` flag: not grouped yet",
    "lab_utils/fused/blocks.py:block_cases": _FACTORY,
}


def long_functions() -> dict[str, str]:
    """``"path:qualname" -> "N lines, M parameters"`` for every function of lab_utils over a limit."""
    found = {}
    for path in sorted((ROOT / "lab_utils").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()

        def visit(node, prefix, rel=rel):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = child.args
                    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                    params = len(names) - (names[:1] in (["self"], ["cls"])) + bool(a.vararg) + bool(a.kwarg)
                    lines = child.end_lineno - child.lineno + 1
                    if lines > MAX_FUNCTION_LINES or params > MAX_PARAMETERS:
                        found[f"{rel}:{prefix}{child.name}"] = f"{lines} lines, {params} parameters"
                    visit(child, f"{prefix}{child.name}.", rel)
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.", rel)
                else:
                    visit(child, prefix, rel)

        visit(ast.parse(path.read_text()), "")
    return found


def test_no_function_too_long_or_with_too_many_parameters():
    """No function in lab_utils over 100 lines or with more than 8 parameters: split it into
    named stages, group its knobs in a dataclass (``BenchOptions``, ``Session``), or give it an
    entry with a reason in FUNCTION_ALLOWED."""
    found = long_functions()
    new = {k: v for k, v in found.items() if k not in FUNCTION_ALLOWED}
    stale = sorted(k for k in FUNCTION_ALLOWED if k not in found)
    assert not new, "functions over the limits (split them, or allow them with a reason):\n" + "\n".join(
        f"{k}: {v}" for k, v in sorted(new.items())
    )
    assert not stale, f"allowed but no longer over the limits (drop them from FUNCTION_ALLOWED): {stale}"
    assert all(len(why) > 10 for why in FUNCTION_ALLOWED.values()), "every allowed function carries its reason"

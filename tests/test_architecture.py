"""The package's shape holds: layers import downwards only, no cycles, no module too long,
no imports of private names across modules, no importlib strings between the project's
modules, and lab_kernels stands alone (a kernel module can be copied out on its own)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lab_kernels", "lab_utils")
MAX_LINES = 600

#: Layers, lowest first: a module may import from its own layer or any layer below.
#: ``lab_utils.<name>`` flat modules are core or libraries; libraries that build on
#: the model (profiler, fused-op benchmarking, memory, distributed, stability) sit above it.
CORE = {
    "config",
    "checks",
    "device",
    "dtypes",
    "cpu_threads",
    "timing",
    "ceilings",
    "roofline",
    "records",
    "plots",
    "flops",
}
LOW_LIBRARIES = {"masks", "attention_paths", "attention_inputs", "attention", "recipes", "precision", "numerics"}


def layer(module: str) -> int:
    parts = module.split(".")
    if parts[0] == "lab_kernels":
        return 0
    if len(parts) == 1:  # lab_utils/__init__
        return 1
    sub = parts[1]
    if sub in CORE:
        return 1
    if sub in LOW_LIBRARIES:
        return 2
    if sub == "model":
        return 3
    if sub == "studies":
        return 5
    if sub == "run":
        return 6
    return 4  # libraries above the model


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
            # the runner imports the LabConfig a notebook names in its metadata: data, not a code dependency
            if isinstance(node, ast.Attribute) and node.attr == "import_module" and mod != "lab_utils.run.runner":
                call_args = [n for n in ast.walk(node) if isinstance(n, ast.Constant)]
                bad.append(f"{mod}: importlib.import_module (line {node.lineno}) {call_args}")
    assert not bad, "private names used across modules / importlib strings:\n" + "\n".join(bad)


def test_the_layers_are_what_the_architecture_page_describes():
    """Every module sits in a known room; a new flat module must be placed in a layer above."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    flat = [m for m in MODS if m.count(".") == 1 and m.startswith("lab_utils.")]
    names = sorted(m.split(".")[1] + ("/" if MODS[m].name == "__init__.py" else "") for m in flat)
    missing = [m for m in names if f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md does not place these lab_utils modules: {missing}"

"""A lab's page around its step (labs 01, 05, 07, 08).

* :func:`load`, in the lab's first cell: the step the ``step`` parameter names, resolved once,
  built on the lab's device, dtype, batch size and seed (and given the lab's config), its checks
  run (a bad factory is refused there, before anything is measured: ``perflab run`` exits 2).
  On a step that is not perflab's MMDiT the lab's recorder keys every row by the step's identity.
* ``%%needs CAPABILITY ...``: the first line of a cell that only a step declaring those
  capabilities can run (``lab_utils.step.contract.CAPABILITIES``: the MMDiT's formula, presets,
  explorers, ...).  On a step without them the cell runs nothing and shows nothing; a headless
  report leaves it out, with the markdown cells tagged ``needs:CAPABILITY``, and the lab's
  :func:`footnote` says in one line per capability what was left out and why.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from IPython import get_ipython
from IPython.display import Markdown, display

from lab_utils.core.device import pick_device
from lab_utils.core.dtypes import parse_dtype
from lab_utils.core.records import Recorder
from lab_utils.step.contract import CAPABILITIES, STEP_PHASES, StepFactory, blocks, identity
from lab_utils.step.load import DEFAULT_STEP, load_step

#: The output metadata a skipped ``%%needs`` cell leaves (the runner drops such cells from a report).
ABSENT_KEY = "absent"
NO_CAPABILITIES = "none beyond the contract (sections that need one are left out)"


@dataclass
class Page:
    """The step a lab measures, and the capabilities its page left out (capability -> cells)."""

    step: StepFactory
    absent: dict = field(default_factory=dict)

    def has(self, *capabilities: str) -> bool:
        return all(self.step.has(c) for c in capabilities)


PAGE: Page | None = None


def step_keywords(cfg) -> dict:
    """The keywords a lab gives its step factory: its device, dtype, batch size, seed, and itself."""
    dtype = getattr(cfg, "dtype", "float32")
    return dict(
        device=str(pick_device(getattr(cfg, "device", "auto"))),
        dtype=parse_dtype("dtype", dtype) if isinstance(dtype, str) else dtype,
        batch_size=getattr(cfg, "batch_size", None),
        seed=getattr(cfg, "seed", 0),
        lab=cfg,
    )


def load(cfg, rec: Recorder | None = None) -> StepFactory:
    """The lab's step (module note); ``rec`` gets the step's identity in its parameters (and, on a
    step that is not the default, in every row).  ``cfg.check_step(step)``, where the lab defines
    it, checks the lab's parameters that name parts of the step (a block, a module)."""
    global PAGE
    step = load_step(cfg.step, **step_keywords(cfg))
    if hasattr(cfg, "check_step"):
        cfg.check_step(step)
    ident = identity(step)
    if rec is not None:
        rec.params["step_identity"] = ident.as_dict()
        if cfg.step != DEFAULT_STEP:
            rec.scope(ident.key, **ident.extra())
    PAGE = Page(step)
    shell = get_ipython()
    if shell is not None:
        shell.register_magic_function(needs, "cell", "needs")
    return step


def step_lines(step: StepFactory) -> list[str]:
    """What the lab measures: the step's identity, blocks, phases and capabilities."""
    bl = blocks(step)
    kinds = sorted({type(m).__name__ for _, m in bl})
    own = [p for p in step.phases if p not in STEP_PHASES]
    caps = sorted(c for c in step.capabilities if c in CAPABILITIES)
    return [
        f"step: {identity(step)}",
        f"blocks: {len(bl)} ({', '.join(kinds) or 'none detected'})"
        + ("" if step.block_class is None else " (given by the factory)"),
        "phases: " + ", ".join([*STEP_PHASES, *(p.name for p in step.periodic), *own]),
        "capabilities: "
        + (", ".join(caps) if caps else "none beyond the contract (sections that need one are left out)"),
    ]


def needs(line: str, cell: str):
    """``%%needs CAPABILITY ...``: run the cell when the lab's step declares every capability
    named, else note them as absent and show nothing (module note)."""
    caps = line.split()
    unknown = [c for c in caps if c not in CAPABILITIES]
    if unknown or not caps:
        raise ValueError(f"%%needs {line!r}: name capabilities among {', '.join(CAPABILITIES)}")
    if PAGE is None:
        raise RuntimeError("%%needs: no step loaded yet (the lab's first cell calls page.load)")
    missing = [c for c in caps if not PAGE.step.has(c)]
    if missing:
        for c in missing:
            PAGE.absent[c] = PAGE.absent.get(c, 0) + 1
        display({"text/plain": ""}, raw=True, metadata={"perflab": {ABSENT_KEY: missing}})
        return None
    shell = get_ipython()
    code = shell.transform_cell(cell)
    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "<%%needs cell>", "exec"), shell.user_ns)  # noqa: S102 - the cell's own code
    if last is not None:  # the cell's last expression is its result, as without the magic
        return eval(compile(ast.Expression(last.value), "<%%needs cell>", "eval"), shell.user_ns)  # noqa: S307
    return None


def footnote_lines(page: Page | None = None) -> list[str]:
    """One line per capability the step lacked: what the left-out sections needed."""
    page = page or PAGE
    if page is None or not page.absent:
        return []
    name = page.step.name or "this step"
    return [f"`{c}`: {CAPABILITIES[c]}; {name} does not declare it" for c in sorted(page.absent)]


def footnote(page: Page | None = None):
    """The footnote of a lab's page (Markdown; nothing when no section was left out)."""
    lines = footnote_lines(page)
    if not lines:
        return None
    return Markdown(
        "**Left out of this page**: the sections that need a capability this step does not declare "
        "(perflab's MMDiT declares them all):\n\n" + "\n".join(f"- {x}" for x in lines)
    )


def finish(page: Page | None = None):
    """The lab's last call: release what its step holds beyond tensors (a trainer's pending async
    saves and checkpoint files) and show the footnote (:func:`footnote`)."""
    page = page or PAGE
    if page is not None and page.step.close is not None:
        page.step.close()
    return footnote(page)

"""Which phase of a training step a user range belongs to: a documented, overridable table.

A range's name is normalised first: ``## forward ##`` -> ``forward`` (the ``##`` marks that
``torch.profiler.record_function`` users and TorchRec put around names are dropped), lower case,
surrounding blanks removed.  The first rule of :data:`DEFAULT_RULES` whose pattern ``search``-es
the normalised name gives the phase; a name no rule matches has no phase.  Nested ranges: the
innermost range that has a phase wins (``nccl:all_reduce`` inside ``## backward ##`` is
communication; attribution in :mod:`lab_utils.traces.attribute`).

=================  ===============================================================================
phase              names (examples from real traces and from the lab's own trainer)
=================  ===============================================================================
``communication``  ``nccl:all_reduce``, ``gloo:broadcast``, ``c10d::...``, ``all2all...``, ``alltoall``
``optimizer``      ``Optimizer.step#SGD.step``, ``Optimizer.zero_grad#...``, ``## optimizer ##``, ``optimizer``
``backward``       ``## backward ##``, ``backward``
``forward``        ``## forward ##``, ``forward``, ``DistributedDataParallel.forward``
``encoders``       ``text_encoding``, ``image_encoding``, ``text_encoder``, ``vae.encode``
``data``           ``data_loading``, ``## data_load ##``, ``enumerate(DataLoader)#...``
``checkpoint``     ``checkpoint``, ``save_checkpoint``, ``dcp.save``
=================  ===============================================================================

The lab's own range names (``lab_utils.model.train.PHASES``) are listed in :data:`LAB_PHASES`
(copied, since this layer may not import the model; tests/unit/traces/test_phases.py checks that the
two stay in step).  MMDiT blocks (``double_blocks.N``, ``single_blocks.N``) are not phases but a
block label: :func:`block_of`.

Override: ``PhaseTable(rules=[("my_fwd", "forward")])`` puts the given rules before the
defaults (``replace=True``: instead of them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lab_utils.core.config import ConfigError

PHASES = ("data", "encoders", "forward", "backward", "optimizer", "checkpoint", "communication")

#: the lab trainer's range names (``lab_utils.model.train.PHASES``) and their phase here
LAB_PHASES = {
    "data_loading": "data",
    "text_encoding": "encoders",
    "image_encoding": "encoders",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer",
    "checkpoint": "checkpoint",
}

DEFAULT_RULES: tuple[tuple[str, str], ...] = (
    (r"^(nccl|gloo|mpi|ucc|xccl):|^c10d::|all2all|alltoall|all_to_all|^record_param_comms$", "communication"),
    (r"^optimizer\.(step|zero_grad)|^optimizer\b|^optim\b|zero_grad", "optimizer"),
    (r"^(data_loading|text_encoding|image_encoding|forward|backward|optimizer|checkpoint)$", "<lab>"),
    (r"backward", "backward"),
    (r"(^|\.)forward\b|^forward|^fwd\b", "forward"),
    (r"text_encod|image_encod|text_encoder|image_encoder|vae\.encode|^encode_(text|image)", "encoders"),
    (r"data_?load|dataloader|^data\b|next_batch|prefetch", "data"),
    (r"checkpoint|save_state|^dcp\.|ckpt", "checkpoint"),
)

_BLOCK = re.compile(r"(double_blocks|single_blocks)\.(\d+)")
_MARKS = re.compile(r"^\s*#+\s*|\s*#+\s*$")


def normalise(name: str) -> str:
    """``## forward ##`` -> ``forward``; lower case."""
    return _MARKS.sub("", name).strip().lower()


def block_of(name: str) -> str | None:
    """``double_blocks.3`` / ``single_blocks.12`` found in a range or module name, else None."""
    m = _BLOCK.search(name)
    return f"{m.group(1)}.{m.group(2)}" if m else None


@dataclass(frozen=True)
class PhaseTable:
    """Range name -> phase (see the module note); ``rules`` go before the defaults."""

    rules: tuple[tuple[str, str], ...] = ()
    replace: bool = False
    _compiled: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for pattern, phase in self.rules:
            if phase not in PHASES:
                raise ConfigError("rules", (pattern, phase), f"a phase among {PHASES}")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError("rules", pattern, f"a valid regular expression ({exc})") from exc
        rules = tuple(self.rules) + (() if self.replace else DEFAULT_RULES)
        object.__setattr__(self, "_compiled", tuple((re.compile(p), ph) for p, ph in rules))

    def phase(self, name: str) -> str | None:
        """The phase of a range called ``name``, or None."""
        text = normalise(name)
        if text.startswith("profilerstep"):
            return None
        for rx, phase in self._compiled:
            if rx.search(text):
                return LAB_PHASES[text] if phase == "<lab>" else phase
        return None

    def table(self) -> list[tuple[str, str]]:
        """The rules in the order they are tried (pattern, phase)."""
        return [(rx.pattern, ph) for rx, ph in self._compiled]

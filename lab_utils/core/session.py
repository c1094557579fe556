"""What every measurement of one run shares (``Session``): the device it runs on, the
recorder its rows go to, the measured ceilings its figures are set against, and the seed
its random inputs start from.  Functions that need three or more of these take a session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lab_utils.core.ceilings import Ceilings
    from lab_utils.core.records import Recorder


@dataclass(frozen=True)
class Session:
    """``device``: a name or ``torch.device``; ``rec``: a :class:`Recorder` or None (nothing
    recorded); ``ceilings``: :class:`Ceilings` or None (no %-of-ceiling figures); ``seed``:
    where the random inputs start."""

    device: str | torch.device = "cpu"
    rec: Recorder | None = None
    ceilings: Ceilings | None = None
    seed: int = 0

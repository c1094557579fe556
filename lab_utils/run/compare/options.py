"""What a comparison may be asked for: thresholds, noise test, rows, gate (``Options``).

Defined beside ``perflab compare``'s arguments in ``lab_utils.run.commands.compare`` (light, so the
command's ``--help`` needs no pandas); the comparison's modules read them from here.
"""

from __future__ import annotations

from lab_utils.run.commands.compare import CONTEXT_DIFFS, Options, lab_name

__all__ = ["CONTEXT_DIFFS", "Options", "lab_name"]

"""Live explorers, one per lab: ipywidgets controls that measure on demand in the kernel.

``base`` holds the shared machinery (:class:`Explorer`); each module holds one lab's
explorer, built on the same library calls the lab's headless path uses.
"""

from lab_utils.studies.explore.base import (
    LIVE_NOTE,
    Control,
    Explorer,
    Interrupted,
    Outcome,
    Progress,
    Result,
    Unavailable,
    is_live,
)

__all__ = ["LIVE_NOTE", "Control", "Explorer", "Interrupted", "Outcome", "Progress", "Result", "Unavailable", "is_live"]

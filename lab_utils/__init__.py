"""perflab: the lab around the kernels (device, timing, roofline, records, reports).

Importing the package is light (no torch, no notebook or plotting package): the ``perflab``
command parses its arguments first and the trace reader runs without torch.  ``lab_kernels``
decides ``TRITON_INTERPRET`` when it is imported, before any of its Triton kernels is defined;
no module here imports Triton itself (``lab_utils.core.device`` reads its version from the
package metadata).
"""

from lab_utils.core.config import ConfigError, LabConfig
from lab_utils.core.noise import install_log_filters

install_log_filters()  # known library log lines stay out of notebooks and reports (see noise.py)

__all__ = ["ConfigError", "LabConfig"]
__version__ = "0.1.0"

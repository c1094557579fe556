"""perflab: the lab around the kernels (device, timing, roofline, records, reports).

``lab_kernels`` is imported first on purpose: it decides ``TRITON_INTERPRET`` before
any Triton kernel can be defined.
"""

import lab_kernels as _lab_kernels  # noqa: F401  (sets TRITON_INTERPRET on CPU-only machines)
from lab_utils.core.config import ConfigError, LabConfig  # noqa: E402
from lab_utils.core.noise import install_log_filters  # noqa: E402

install_log_filters()  # known library log lines stay out of notebooks and reports (see noise.py)

__all__ = ["ConfigError", "LabConfig"]
__version__ = "0.1.0"

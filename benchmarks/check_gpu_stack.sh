#!/usr/bin/env bash
# The GPU check's CPU path on the GPU machine's software stack (not part of `make test`).
#
# The lent H200 machine runs Python 3.12 with torch 2.11, triton 3.6 and numpy 2.5 (KINDS.md of
# the device tool), not the versions pinned here (torch 2.13, triton 3.9, numpy 2.4).  This
# script builds that stack in a virtual environment outside the repository and runs
#     benchmarks/gpu_check.py --device cpu
# in it, so that what breaks there (triton 3.6's interpreter with numpy >= 2.4, torch 2.11's
# CPU _scaled_mm that takes per-tensor scales only) shows here first.
#
# Cost: PyPI serves only CUDA builds of torch for Linux; `import torch` needs their nvidia-*
# wheels even on a machine without a GPU: about 3 GB downloaded, 4.8 GB installed (once).
#
#   benchmarks/check_gpu_stack.sh                 # build (first time) and run; exit code = gpu_check's
#   STACK_VENV=/tmp/other NUMPY=2.5.5 benchmarks/check_gpu_stack.sh
#   OUT=/tmp/result benchmarks/check_gpu_stack.sh --sections fused,fp8   # extra args go to gpu_check
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${STACK_VENV:-/tmp/stack211}"
TORCH="${TORCH:-2.11.0}"
TRITON="${TRITON:-3.6.0}"
NUMPY="${NUMPY:-2.5.5}"  # the newest 2.5 on PyPI when this was written (the machine had 2.5.2)
OUT="${OUT:-/tmp/gpu_check-stack-torch${TORCH}}"

find_python312() {
    for p in "${PYTHON:-}" python3.12 "$HOME/.pyenv/versions/3.12"*/bin/python; do
        [ -n "$p" ] || continue
        if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            command -v "$p"
            return 0
        fi
    done
    return 1
}

marker="$VENV/.stack-$TORCH-$TRITON-$NUMPY"
if [ ! -e "$marker" ]; then
    PY="$(find_python312)" || { echo "check_gpu_stack: no Python 3.12 found (set PYTHON=...)" >&2; exit 2; }
    echo "check_gpu_stack: building $VENV with $PY: torch $TORCH, triton $TRITON, numpy $NUMPY"
    "$PY" -m venv "$VENV"
    # PIP_CONSTRAINT='': this machine's pip constraints cap torch at the CPU wheel on its disk
    PIP_CONSTRAINT='' "$VENV/bin/pip" install -q "torch==$TORCH" "triton==$TRITON" "numpy==$NUMPY" \
        "setuptools<82" pandas tqdm einops pyyaml scipy safetensors
    touch "$marker"
fi
"$VENV/bin/python" -c 'import numpy, torch, triton; print("stack:", "torch", torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)'
cd "$ROOT"
set +e
PERFLAB_CACHE="${PERFLAB_CACHE:-$OUT.cache}" "$VENV/bin/python" benchmarks/gpu_check.py --device cpu --out "$OUT" "$@"
rc=$?
set -e
echo "check_gpu_stack: gpu_check --device cpu exited $rc on torch $TORCH / triton $TRITON / numpy $NUMPY ($OUT)"
exit $rc

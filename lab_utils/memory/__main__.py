"""``python -m lab_utils.memory fsdp PRESET WORLD_SIZES OUT_DIR`` (sizes comma-separated)."""

import sys

from lab_utils.memory.fsdp import main

main(sys.argv)

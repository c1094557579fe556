"""``python -m lab_utils.memory fsdp PRESET WORLD_SIZE OUT_DIR``."""

import sys

from .fsdp import main

main(sys.argv)

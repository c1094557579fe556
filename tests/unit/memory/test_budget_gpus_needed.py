"""How many GPUs a step needs: the fewest ranks whose per-rank predicted peak fits the device,
at the edges where one byte decides (activations are not sharded, so the peak falls with the
rank count only through the state)."""

from lab_utils import memory as mem
from lab_utils.model import resolve_config


def test_gpus_needed_is_the_fewest_ranks_that_fit():
    cfg, sh = resolve_config("tiny"), mem.StepShape(2, 16, 5)
    peak = {n: mem.predicted_peak(cfg, sh, "float32", "none", shards=n)["total"] for n in (1, 2, 3)}
    assert peak[1] > peak[2] > peak[3]
    assert mem.gpus_needed(cfg, sh, "float32", "none", peak[1]) == 1
    assert mem.gpus_needed(cfg, sh, "float32", "none", peak[1] - 1) == 2
    assert mem.gpus_needed(cfg, sh, "float32", "none", peak[3]) == 3
    assert mem.gpus_needed(cfg, sh, "float32", "none", peak[3], max_gpus=3) == 3  # the last count tried
    assert mem.gpus_needed(cfg, sh, "float32", "none", peak[3] - 1, max_gpus=3) is None

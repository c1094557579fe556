"""Lab 07's explorer (stability): an intervention -> telemetry curves beside the earlier runs.

Each run is ``stability.train_run`` of a :class:`~lab_utils.stability.training.RunSpec` with one
setting changed (precision mode, spike policy, a provoked spike, QK-norm): the same
initialisation, batches, noise and timesteps as every other run of the explorer, so the
curves differ by the setting alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import holoviews as hv
import pandas as pd

from lab_utils.stability.training import PRECISIONS, PROVOKE, SPIKE_POLICIES, RunSpec, train_run
from lab_utils.studies.explore.base import Control, Explorer, Progress, Result

STEPS = 12


@dataclass
class StabilityExplorer(Explorer):
    """``StabilityExplorer.for_lab(cfg, rec).show()`` (or ``StabilityExplorer(rec)``)."""

    steps: int = STEPS

    lab: ClassVar[str] = "07_stability"
    title: ClassVar[str] = "Explore: one intervention on a short training run"
    live_help: ClassVar[str] = "pick precision, spike policy, a provoked spike, QK-norm: the run's curves land beside"
    controls: ClassVar[tuple[Control, ...]] = (
        Control("precision", PRECISIONS, "fp32"),
        Control("spike_policy", SPIKE_POLICIES, "none", "spike policy"),
        Control("provoke", PROVOKE, "none", "provoke a spike"),
        Control("qk_norm", (), True, "QK-norm"),
    )

    @classmethod
    def for_lab(cls, cfg, rec=None) -> StabilityExplorer:
        """The lab's explorer (short MMDiT runs: the notebook shows it on a step with ``explorer``)."""
        return cls(rec=rec)

    def spec(self, cfg: dict) -> RunSpec:
        return RunSpec(
            name=self.label(cfg),
            steps=self.steps,
            batch_size=2,
            num_batches=4,
            provoke_step=self.steps // 2,
            precision=cfg["precision"],
            spike_policy=cfg["spike_policy"],
            provoke=cfg["provoke"],
            qk_norm=cfg["qk_norm"],
            telemetry_every=2,
        )

    def measure(self, cfg: dict, progress: Progress) -> Result:
        spec = self.spec(cfg)
        progress(0, 1, f"training {spec.steps} steps")
        res = train_run(spec)
        progress(1, 1, "trained")
        label = self.label(cfg)
        st = res.steps
        for r in st.itertuples():
            self.rec.add("explore", label, "loss", r.loss, "", statistic=f"step{r.step}", **cfg)
            self.rec.add("explore", label, "grad_norm", r.grad_norm, "", statistic=f"step{r.step}", **cfg)
        spikes = int(st["spike"].astype(bool).sum()) if "spike" in st else 0
        self.rec.add("explore", label, "final_loss", res.final_loss(), "", statistic="mean_last_quarter", **cfg)
        self.rec.add("explore", label, "spikes", spikes, "steps", statistic="count", **cfg)
        row = dict(**cfg, final_loss=res.final_loss(), spikes=spikes, max_grad_norm=float(st.grad_norm.max()))
        row["replayed"] = res.replayed_steps
        tel = res.telemetry
        act = tel[tel["stat"] == "act_max"].groupby("step", as_index=False)["value"].max()
        return Result(0, cfg, row, data=dict(steps=st[["step", "loss", "grad_norm"]].copy(), act=act))

    def figures(self, results: list[Result]) -> list:
        parts = [r.data["steps"].assign(run=f"#{r.index} {self.label(r.config)}") for r in results]
        df = pd.concat(parts) if parts else pd.DataFrame(columns=["step", "loss", "grad_norm", "run"])
        common = dict(color="run", cmap="Category10", size=5, tools=["hover"], show_legend=False, framewise=True)
        loss = hv.Scatter(df, "step", ["loss", "run"]).opts(title="Loss per step of each run", **common)
        grad = hv.Scatter(df, "step", ["grad_norm", "run"]).opts(title="Gradient norm per step", logy=True, **common)
        acts = [r.data["act"].assign(run=f"#{r.index} {self.label(r.config)}") for r in results]
        act = pd.concat(acts) if acts else pd.DataFrame(columns=["step", "value", "run"])
        act_max = hv.Scatter(act, "step", ["value", "run"]).opts(
            title="Largest activation over the blocks (telemetry)", ylabel="max |activation|", logy=True, **common
        )
        return [loss, grad, act_max]

"""Saving a training run's state every N steps: model and optimizer with ``torch.save`` or
``torch.distributed.checkpoint`` (synchronous or async); the latest checkpoint only is kept.
("checkpoint" alone means this; the activation-checkpointing policies are
``lab_utils.model.checkpointing``.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from lab_utils.core.config import check_choice

CKPT_FORMATS = ("torch", "dcp", "dcp_async")


class Checkpointer:
    """Saves model + optimizer state every N steps; keeps only the latest checkpoint.

    * torch: ``torch.save`` of both state dicts into one file;
    * dcp: ``torch.distributed.checkpoint.save`` (a directory of shards + metadata);
    * dcp_async: ``dcp.async_save``: the step blocks only while state is staged; the
      write finishes in the background (the previous save is awaited before the next)."""

    def __init__(self, directory: str | Path, fmt: str = "torch"):
        check_choice("ckpt_format", fmt, CKPT_FORMATS)
        self.dir, self.fmt = Path(directory), fmt
        self.dir.mkdir(parents=True, exist_ok=True)
        self._pending = None
        self.saved: list[Path] = []

    def _state(self, model, opt):

        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def save(self, model, opt, step: int) -> Path:
        self.wait()
        if self.fmt == "torch":
            path = self.dir / f"step_{step:06d}.pt"
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, path)
        else:
            path = self.dir / f"step_{step:06d}"
            state = self._state(model, opt)
            if self.fmt == "dcp":
                dcp.save(state, checkpoint_id=str(path))
            else:
                self._pending = dcp.async_save(state, checkpoint_id=str(path))
        previous, self.saved = self.saved, [path]
        self._old = previous
        if self._pending is None:
            self._prune()
        return path

    def _prune(self):
        for p in getattr(self, "_old", []):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        self._old = []

    def wait(self):
        if self._pending is not None:
            self._pending.result()
            self._pending = None
            self._prune()

    def load_into(self, model, opt, path: str | Path | None = None) -> None:
        """Restore the latest (or given) checkpoint into model and optimizer."""
        self.wait()
        path = Path(path or self.saved[-1])
        if path.suffix == ".pt":
            state = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
        else:
            state = self._state(model, opt)
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

"""Lightning callbacks and plugins that textrl adds: temperature decay and atomic checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


class TemperatureSchedule(L.Callback):
    """Sampling temperature x ``decay`` after every iteration, never below ``floor``.

    Its state is saved in checkpoints by Lightning, so a resumed run samples at the same temperature.
    """

    def __init__(self, start: float, decay: float, floor: float):
        self.temperature = start
        self.decay = decay
        self.floor = floor

    def on_train_start(self, trainer, pl_module):
        pl_module.temperature = self.temperature

    def on_train_epoch_end(self, trainer, pl_module):
        self.temperature = max(self.floor, self.temperature * self.decay)
        pl_module.temperature = self.temperature

    def state_dict(self):
        return {"temperature": self.temperature}

    def load_state_dict(self, state_dict):
        self.temperature = state_dict["temperature"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the same directory, fsync, then rename over the target.

    A run killed mid-write leaves the previous checkpoint intact (rename is atomic on POSIX).
    """

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

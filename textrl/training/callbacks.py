"""How textrl writes and reads checkpoints: atomically, and without unpickling code."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """Write to a temporary file in the same directory, fsync, then rename over the target: a run
    killed mid-write leaves the previous checkpoint intact (rename is atomic on POSIX).

    Reads with ``weights_only=True``: a shared checkpoint is data, and unpickling it must not be
    able to run code (``textrl.policy.checkpoint.load`` lists the few types it may hold).
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

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        from textrl.policy.checkpoint import load

        return load(path)

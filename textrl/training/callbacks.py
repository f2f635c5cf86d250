"""Trainer plug-ins: checkpoints written atomically and read without unpickling code, and an
evaluation of the final iteration inside ``fit``."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from textrl.policy.checkpoint import load


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
        return load(path)


class EvaluateLastIteration(L.Callback):
    """The last epoch of ``fit`` validates too, whether or not its number is a multiple of
    ``check_val_every_n_epoch`` (``eval.every``): the final policy's evaluation then runs inside the
    fit loop like the others, where ModelCheckpoint judges it (a stand-alone ``validate`` saves no
    checkpoint), so ``best-N.ckpt`` is written whenever an evaluation is the best so far.

    Lightning has no option for this (Lightning-AI/pytorch-lightning#4539, #12473); the Trainer's
    ``check_val_every_n_epoch`` is read at every epoch's end, so the last epoch sets it to 1."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # at the end of the epoch's batch (one PPO iteration: one batch), right before Lightning
        # decides whether to validate; a run resumed from last.ckpt passes here as well
        if trainer.current_epoch + 1 == trainer.max_epochs:
            trainer.check_val_every_n_epoch = 1

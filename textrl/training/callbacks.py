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

    Lightning has no option for this (Lightning-AI/pytorch-lightning#4539, #12473). It decides after
    each epoch's last batch, from ``trainer.check_val_every_n_epoch``: the last epoch sets it to 1
    there, and puts it back once the evaluation is done."""

    def __init__(self):
        self.every: int | None = None  # the Trainer's own setting while the last epoch overrides it

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # one PPO iteration is one batch; a run resumed from last.ckpt passes here as well
        if trainer.current_epoch + 1 == trainer.max_epochs and trainer.check_val_every_n_epoch != 1:
            self.every, trainer.check_val_every_n_epoch = trainer.check_val_every_n_epoch, 1

    def on_validation_end(self, trainer, pl_module):
        # before ModelCheckpoint's own hook (checkpoint callbacks run last): with the setting back,
        # `best` judges this evaluation when it ends, as every other one, and last.ckpt, written at
        # the epoch's end, holds its verdict
        if self.every is not None:
            trainer.check_val_every_n_epoch, self.every = self.every, None

"""Trainer plug-ins: checkpoints written atomically and read without unpickling code, an
evaluation of the final iteration inside ``fit``, and a stop at an iteration's end on a signal."""

from __future__ import annotations

import logging
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from textrl.policy.checkpoint import load

log = logging.getLogger(__name__)


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


class Interrupted(Exception):
    """A run stopped by a signal after an iteration, whose ``last.ckpt`` holds it: started again in
    its run directory, it resumes from there."""

    def __init__(self, signum: int, iterations_done: int, iterations: int, run_dir: Path):
        self.signum = signum
        again = f"the same overrides and hydra.run.dir={run_dir}"
        super().__init__(f"stopped by {signal.Signals(signum).name} after iteration {iterations_done} of {iterations}; "
                         + (f"{run_dir / 'checkpoints' / 'last.ckpt'} holds it: start the run again in its directory "
                            f"({again}) to resume" if iterations_done else f"start it again ({again}) to begin"))


class StopOnSignal(L.Callback):
    """SIGTERM, and SIGUSR1/SIGUSR2 where nothing else handles them, stop the run at the end of the
    current iteration, after its ``last.ckpt``; ``train`` then raises ``Interrupted`` (``python
    train.py`` exits with 128 + the signal's number).

    SIGUSR1 is what Lightning's SLURM auto-requeue listens for (it would save a checkpoint in the
    middle of an iteration and requeue the job itself) and SIGUSR2 what submitit sends before a
    timeout; a signal some launcher already handles (submitit's USR2: it requeues the job and exits
    at once) is left to it. Every rank decides together at each iteration's end (one all-reduce),
    so all of them stop after the same iteration."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)

    def __init__(self):
        self.signum: int | None = None  # the first stop signal received (on any rank, once decided)
        self._previous: dict[int, object] = {}

    @contextmanager
    def listening(self):
        """The handlers installed for as long as the context lasts (the main thread only: Python
        delivers signals there), the previous ones put back after."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for signum in self.SIGNALS:
            current = signal.getsignal(signum)
            if current is not signal.SIG_IGN and (signum == signal.SIGTERM or current in (signal.SIG_DFL, None)):
                self._previous[signum] = current
                signal.signal(signum, self._received)
        try:
            yield self
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
            self._previous = {}

    def _received(self, signum, frame):
        if self.signum is None:
            log.warning("%s received: stopping after this iteration's checkpoint", signal.Signals(signum).name)
            self.signum = signum
        previous = self._previous.get(signum)
        if callable(previous):  # e.g. submitit's SIGTERM logger
            previous(signum, frame)

    def on_train_epoch_end(self, trainer, pl_module):
        # before the fit loop decides whether to go on; last.ckpt is written in this hook too
        if trainer.strategy.reduce_boolean_decision(self.signum is not None, all=False):
            self.signum = self.signum or signal.SIGTERM  # another rank's signal
            trainer.should_stop = True

"""Jobs of one multirun side by side on one machine (``sweep=cpu``, ``sweep=gpus``): each job claims a
free slot of the machine, a GPU or a group of ``threads`` cores, for as long as it runs.

Hydra's joblib launcher runs ``hydra.launcher.n_jobs`` jobs at once in reused worker processes but
gives them no device: a job that picked ``job.num % GPUs`` would share a GPU as soon as jobs end out
of order. A slot is an exclusive lock file in the sweep folder (``<sweep>/.slots/slot<i>.lock``,
POSIX ``flock``): the kernel releases it when the job ends or its process dies, so a killed job never
keeps a slot, and a new job takes the first slot nobody holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch

from textrl.config import TrainConfig
from textrl.errors import ConfigError
from textrl.policy.device import uses_cuda

log = logging.getLogger(__name__)

# The cores this process may use before any job pinned it: a reused worker keeps the previous job's
# pinning, so the machine's cores are read once, when the module is first imported.
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def on_slot(cfg: TrainConfig, slot: int | None) -> TrainConfig:
    """The job's config on its slot (``machine_slot``): on GPUs, ``trainer.devices`` is the slot's GPU."""
    if slot is None or not uses_cuda(cfg.trainer.accelerator):
        return cfg
    return replace(cfg, trainer=replace(cfg.trainer, devices=[slot]))


def slot_count(cfg: TrainConfig, on_gpu: bool) -> int:
    if on_gpu:
        return torch.cuda.device_count()
    if not cfg.threads:
        raise ConfigError("trainer.share_machine=true on CPUs needs threads=T, the cores each job uses "
                          f"(this machine has {len(_CORES)}: run at most {len(_CORES)}/T jobs at once)")
    return len(_CORES) // cfg.threads


@contextlib.contextmanager
def machine_slot(cfg: TrainConfig):
    """Hold a free slot while the job runs, and yield its number (None unless ``trainer.share_machine``):
    on GPUs the slot's GPU is the job's (``on_slot``); on CPUs the process is pinned to the slot's
    ``threads`` cores."""
    if not cfg.trainer.share_machine:
        yield None
        return
    on_gpu = uses_cuda(cfg.trainer.accelerator)
    slots = slot_count(cfg, on_gpu)
    folder = Path(cfg.output_dir).parent / ".slots"  # a multirun's jobs are siblings in its sweep folder
    folder.mkdir(parents=True, exist_ok=True)
    for slot in range(slots):
        handle = open(folder / f"slot{slot}.lock", "w")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            handle.close()
    else:
        raise ConfigError(f"trainer.share_machine: all {slots} slots of this machine are taken by other jobs "
                          f"in {folder.parent}; run at most {slots} jobs at once (hydra.launcher.n_jobs={slots})")
    try:
        if on_gpu:
            log.info("trainer.share_machine: GPU %d (slot %d of %d)", slot, slot, slots)
        else:
            cores = _CORES[slot * cfg.threads:(slot + 1) * cfg.threads]
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cores)
                log.info("trainer.share_machine: cores %s (slot %d of %d)", cores, slot, slots)
            else:  # macOS: no pinning; threads=T alone keeps the jobs to their share
                log.info("trainer.share_machine: slot %d of %d, %d threads (this OS cannot pin cores)",
                         slot, slots, cfg.threads)
        yield slot
    finally:
        handle.close()  # releases the lock

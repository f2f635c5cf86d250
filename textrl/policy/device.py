"""The one device this process computes on: every place that puts a model or a tensor somewhere
asks ``process_device``.

Lightning decides the device of the Trainer; textrl also places things before the Trainer exists
(the walkthrough warm start, a QLoRA model that bitsandbytes quantises as it is loaded) and in the
command-line tools, which have no Trainer. All of them must agree with Lightning, which puts rank
``r`` of a node on ``trainer.devices[r]`` when ``devices`` lists GPUs, and on ``cuda:r`` otherwise:

* ``sweep=gpus`` gives each job ``trainer.devices=[slot]``, and sets no ``LOCAL_RANK``: ``cuda:slot``;
* ``trainer.devices=[2,3]`` (or ``"2,3"``) under DDP: rank 0 on ``cuda:2``, rank 1 on ``cuda:3``;
* torchrun and Lightning's own launcher set ``LOCAL_RANK``; SLURM sets ``SLURM_LOCALID``.

``LOCAL_RANK`` used as a GPU index put every sweep job's warm start (and CUDA context) on GPU 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (torchrun, Lightning's launcher), else
    ``SLURM_LOCALID`` (srun), else 0."""
    env = os.environ if environ is None else environ
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        if env.get(key, "").strip():
            return int(env[key])
    return 0


def gpu_indices(devices: Any) -> list[int] | None:
    """The GPU indices ``trainer.devices`` names, as Lightning reads them: a list (``[2, 3]``, or the
    strings ``"2,3"`` and ``"2,"``) names GPUs; a count (``2``, ``"2"``), ``-1`` or ``"auto"`` names
    none (the ranks take ``cuda:0..n-1``): None."""
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            return [int(x) for x in text.split(",") if x.strip()]
        return None  # "auto", "-1", or a count
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__iter__") and not isinstance(devices, (bytes, int))):
        return [int(x) for x in devices]
    return None


def uses_cuda(accelerator: str) -> bool:
    """Whether the Trainer will train on CUDA: asked for (``gpu``/``cuda``), or ``auto`` where
    CUDA is present."""
    return accelerator in {"gpu", "cuda"} or (accelerator == "auto" and torch.cuda.is_available())


def process_device(accelerator: str = "auto", devices: Any = 1, environ: Mapping[str, str] | None = None,
                   cuda: bool | None = None) -> torch.device:
    """The device of this process: the CPU, or the GPU Lightning gives this rank (module docstring).
    ``cuda`` overrides whether CUDA is used (tests; None: ``uses_cuda(accelerator)``)."""
    if not (uses_cuda(accelerator) if cuda is None else cuda):
        return torch.device("cpu")
    rank = local_rank(environ)
    listed = gpu_indices(devices)
    if listed is None:
        return torch.device("cuda", rank)
    if rank >= len(listed):
        raise ValueError(f"local rank {rank} has no GPU in trainer.devices={devices!r} (one GPU per rank)")
    return torch.device("cuda", listed[rank])


def trainer_device(trainer, environ: Mapping[str, str] | None = None) -> torch.device:
    """``process_device`` for a ``TrainerConfig``."""
    return process_device(trainer.accelerator, trainer.devices, environ)

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
import time
from collections.abc import Mapping
from typing import Any

import torch

from textrl.config import gpu_indices


def local_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (torchrun, Lightning's launcher), else
    ``SLURM_LOCALID`` (srun), else 0."""
    env = os.environ if environ is None else environ
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        if env.get(key, "").strip():
            return int(env[key])
    return 0


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


def ints_to_device(parts: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """Host integer lists (token ids, positions, cache slots, fork children...) as int64 tensors on
    ``device``, in ONE copy: concatenated, copied, split into views.

    Each host list copied on its own is one synchronisation per list on a GPU (a copy from pageable
    memory waits for it); a model call needs several. On CUDA the buffer is pinned and copied
    without blocking: the host goes on queueing work (the caching host allocator keeps the pinned
    block until the copy has run)."""
    sizes = [len(v) for v in parts.values()]
    flat = torch.tensor([x for v in parts.values() for x in v], dtype=torch.long)
    device = torch.device(device)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    return dict(zip(parts, flat.split(sizes)))


class PhaseTimer:
    """Seconds spent in named phases (``with timer.phase("prefill"): ...``), on the device's own
    clock. On CUDA a host timer stops when the kernels are queued, not when they have run, so there
    each phase records a pair of CUDA events and ``seconds`` reads them (one synchronisation, when
    the figures are read); on a CPU the host clock is the device's."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.host: dict[str, float] = {}
        self.events: dict[str, list] = {}

    def phase(self, name: str):
        return _CudaPhase(self, name) if self.cuda else _HostPhase(self, name)

    def seconds(self, name: str) -> float:
        if not self.cuda:
            return self.host.get(name, 0.0)
        pairs = self.events.get(name, [])
        if pairs:
            pairs[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in pairs) / 1000.0


class _HostPhase:
    def __init__(self, timer: PhaseTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.timer.host[self.name] = self.timer.host.get(self.name, 0.0) + time.perf_counter() - self.start


class _CudaPhase:
    def __init__(self, timer: PhaseTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.start.record()

    def __exit__(self, *exc):
        self.end.record()
        self.timer.events.setdefault(self.name, []).append((self.start, self.end))

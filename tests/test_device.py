"""The one rule for a process's device (``textrl.policy.device.process_device``), over every way a
process is launched, and the places that must ask it instead of reading ``LOCAL_RANK`` as a GPU index.

Lightning puts rank ``r`` of a node on ``trainer.devices[r]`` when ``devices`` lists GPUs, else on
``cuda:r``; ``r`` is ``LOCAL_RANK`` (torchrun, Lightning's launcher), else ``SLURM_LOCALID`` (srun),
else 0. ``cuda=True`` and an explicit environment stand in for a GPU machine: the rule itself
touches no GPU. Before it, a ``sweep=gpus`` job (``trainer.devices=[slot]``, no ``LOCAL_RANK``)
warm-started and loaded QLoRA on GPU 0, whatever its slot.
"""

from __future__ import annotations

import pytest
import torch

from textrl.config import MemoryConfig, TrainerConfig, load_model_config, register_configs
from textrl.policy import device as device_module
from textrl.policy.device import local_rank, process_device, trainer_device
from tests.conftest import config

def gpu(index: int) -> torch.device:
    return torch.device("cuda", index)


@pytest.mark.parametrize("case, devices, environ, expected", [
    ("one process, one GPU", 1, {}, gpu(0)),
    ("one process, devices=auto", "auto", {}, gpu(0)),
    ("sweep=gpus slot 3: devices=[3], no LOCAL_RANK", [3], {}, gpu(3)),
    ("sweep slot as a string list", "3,", {}, gpu(3)),
    ("DDP devices=[2,3], rank 0", [2, 3], {"LOCAL_RANK": "0"}, gpu(2)),
    ("DDP devices=[2,3], rank 1", [2, 3], {"LOCAL_RANK": "1"}, gpu(3)),
    ('DDP devices="2,3", rank 0', "2,3", {"LOCAL_RANK": "0"}, gpu(2)),
    ('DDP devices="2,3", rank 1', "2,3", {"LOCAL_RANK": "1"}, gpu(3)),
    ("DDP devices=2 (a count), rank 1", 2, {"LOCAL_RANK": "1"}, gpu(1)),
    ("SLURM: devices=2, SLURM_LOCALID=1", 2, {"SLURM_LOCALID": "1"}, gpu(1)),
    ("SLURM with listed GPUs", [4, 5], {"SLURM_LOCALID": "1"}, gpu(5)),
    ("LOCAL_RANK before SLURM_LOCALID", [2, 3], {"LOCAL_RANK": "0", "SLURM_LOCALID": "1"}, gpu(2)),
    ("an empty LOCAL_RANK is no rank", [2, 3], {"LOCAL_RANK": "", "SLURM_LOCALID": "1"}, gpu(3)),
])
def test_each_launcher_and_rank_gets_the_gpu_lightning_gives_it(case, devices, environ, expected):
    assert process_device("gpu", devices, environ, cuda=True) == expected, case
    assert process_device("auto", devices, environ, cuda=True) == expected, case


@pytest.mark.parametrize("accelerator", ["cpu"])
@pytest.mark.parametrize("devices, environ", [(1, {}), ([3], {}), ([2, 3], {"LOCAL_RANK": "1"}),
                                              (2, {"SLURM_LOCALID": "1"})])
def test_a_cpu_run_computes_on_the_cpu_whatever_the_ranks(accelerator, devices, environ):
    assert process_device(accelerator, devices, environ) == torch.device("cpu")
    assert process_device("gpu", devices, environ, cuda=False) == torch.device("cpu")


def test_without_cuda_auto_is_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    assert process_device() == torch.device("cpu")
    assert process_device("auto", [3], {"LOCAL_RANK": "0"}) == torch.device("cpu")


@pytest.mark.parametrize("devices, environ", [([2, 3], {"LOCAL_RANK": "2"}), ("2,3", {"SLURM_LOCALID": "5"}),
                                              ([3], {"LOCAL_RANK": "1"})])
def test_a_rank_beyond_the_listed_gpus_is_a_clear_error(devices, environ):
    rank = local_rank(environ)
    with pytest.raises(ValueError, match=f"local rank {rank} has no GPU in trainer.devices=.*one GPU per rank"):
        process_device("gpu", devices, environ, cuda=True)


def test_local_rank_reads_torchrun_then_slurm_then_zero():
    assert local_rank({}) == 0
    assert local_rank({"SLURM_LOCALID": "3"}) == 3
    assert local_rank({"LOCAL_RANK": "1", "SLURM_LOCALID": "3"}) == 1


def test_trainer_device_reads_the_trainer_config():
    # accelerator=gpu means CUDA whether or not this machine has it (validation refuses it without):
    # the rule is computed, nothing is placed
    assert trainer_device(TrainerConfig(accelerator="gpu", devices=[3]), {}) == gpu(3)
    assert trainer_device(TrainerConfig(accelerator="gpu", devices=[2, 3]), {"LOCAL_RANK": "1"}) == gpu(3)
    assert trainer_device(TrainerConfig(accelerator="cpu", devices=[2, 3]), {"LOCAL_RANK": "1"}) == torch.device("cpu")


class Asked:
    """Records each call of the real function it wraps (the answer is the real one)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.fn(*args, **kwargs)


def test_the_warm_starts_fabric_is_on_the_trainers_device(tmp_path, monkeypatch):
    import textrl.training.warm_start as warm_start

    asked = Asked(trainer_device)
    monkeypatch.setattr(warm_start, "trainer_device", asked)  # fails before: make_fabric read LOCAL_RANK itself
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank, never a GPU index
    register_configs()
    cfg = config(tmp_path, "trainer.accelerator=cpu")
    fabric = warm_start.make_fabric(cfg)
    assert [args[0] for args, _ in asked.calls] == [cfg.trainer]
    assert fabric.device == trainer_device(cfg.trainer) == torch.device("cpu")


def test_qlora_loads_on_the_device_it_is_given_else_process_device(tmp_path, monkeypatch):
    """A 4-bit model is placed as it loads: on the caller's device (training passes the Trainer's),
    else on ``process_device()``; the value head goes beside it."""
    import textrl.policy.model as model

    folder = tmp_path / "model"
    policy, tokenizer = model.build_policy(load_model_config("tiny"))
    policy.lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    cfg = load_model_config("tiny", source="hub", path=str(folder))
    memory = MemoryConfig(lora=True, quantize_4bit=True)
    asked = Asked(device_module.process_device)
    monkeypatch.setattr(model, "process_device", asked)  # fails before: load_lm read LOCAL_RANK itself
    built, _ = model.build_policy(cfg, memory=memory)
    assert len(asked.calls) == 1
    on = {t.device for t in [*built.parameters(), *built.buffers()]}
    assert on == {process_device()}
    built, _ = model.build_policy(cfg, memory=memory, device=torch.device("cpu"))
    assert len(asked.calls) == 1  # the caller's device: not asked again
    assert {t.device for t in [*built.parameters(), *built.buffers()]} == {torch.device("cpu")}

"""What only a GPU can check: the CUDA paths that docs/gpu.md marks "read only", run for real.
Skipped without a GPU (marker ``cuda``: ``pytest -m cuda``); ``bench/gpu_check.py`` runs them first
and records the outcome in ``bench/results/gpu_check.json``. Real tiny runs on real games."""

import gc

import pytest
import torch

import textrl.cli.train as cli
from textrl.config import native_bf16, run_gpus
from textrl.errors import NonFiniteError
from tests.conftest import config
from tests.test_memory import check_memory_option
from tests.test_nonfinite import NaNLoss
from tests.test_qlora import model_dir  # noqa: F401  (a fixture: the tiny model saved as a pretrained one)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = ["trainer.accelerator=gpu", "trainer.devices=1"]


@pytest.mark.parametrize("memory, extra", [
    ("none", []), ("bf16", []), ("fp16", []), ("adam8bit", []), ("grad_ckpt", []), ("lora", []), ("lowmem", []),
])
def test_each_memory_option_trains_an_iteration_on_the_gpu_at_ratio_one(tmp_path, memory, extra):
    if memory == "bf16" and not native_bf16(True, [0]):
        pytest.skip("bf16 needs compute capability 8.0 (Ampere) or later")
    row = check_memory_option(tmp_path, memory, [*GPU, *extra])
    assert float(row["perf/peak_mem_gb"]) > 0  # the job's own GPU's peak (job_gpu resets it)


def test_qlora_trains_an_iteration_on_the_gpu_at_ratio_one(tmp_path, model_dir):  # noqa: F811
    """4-bit weights quantised on the GPU as the (saved, pretrained-like) tiny model loads."""
    if not native_bf16(True, [0]):
        pytest.skip("memory=qlora computes in bf16: compute capability 8.0 (Ampere) or later")
    row = check_memory_option(tmp_path, "qlora", [*GPU, "model.source=hub", f"model.path={model_dir}"])
    assert float(row["perf/peak_mem_gb"]) > 0


def test_a_persistent_nan_under_fp16_stops_the_run_on_the_gpu(tmp_path, monkeypatch):
    """GradScaler on CUDA skips a non-finite step itself; textrl still counts it toward
    ppo.max_skipped_steps and stops (textrl/ppo/skipped_steps.py)."""
    nan = NaNLoss(monkeypatch, iterations={1})
    cfg = config(tmp_path, *GPU, "memory=fp16", "iterations=2", "eval.every=2", "ppo.max_skipped_steps=2")
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        cli.train(cfg, callbacks=[nan])


def test_a_job_gives_back_the_gpu_memory_it_used(tmp_path):
    """``run_job`` (what ``python train.py`` and every sweep=gpus job runs) leaves nothing allocated
    and nothing reserved on the GPU once it returns."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    cli.run_job(config(tmp_path, *GPU, "iterations=1", "eval.every=1"))
    assert torch.cuda.memory_allocated(0) <= before
    assert torch.cuda.memory_reserved(0) == 0 or torch.cuda.memory_reserved(0) <= torch.cuda.memory_allocated(0) + (2 << 20)


def test_auto_precision_asks_the_gpus_the_run_trains_on(tmp_path):
    gpus = run_gpus(config(tmp_path, *GPU).trainer)
    assert gpus == [0]
    assert native_bf16(True, gpus) == (torch.cuda.get_device_capability(0) >= (8, 0))

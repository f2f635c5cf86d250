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


@torch.no_grad()
def test_the_batched_layout_computes_on_the_gpu_what_each_row_computes_alone(tiny, prompts, easy_games):
    """The compiled FlexAttention path of the rollout's batched layout (``ragged_attention``: the
    cache read in place, a block mask of each row's own blocks) against each row fed alone, fp32,
    through a relayout, a row fed nothing and single-token calls."""
    import copy

    from tests.test_ragged_cache import real_prompts
    from textrl.policy.speed.ragged_cache import RaggedCache

    policy = copy.deepcopy(tiny[0]).cuda()
    texts = real_prompts(prompts, easy_games, 12)
    rows = [sum(texts[r::3], []) for r in range(3)]
    cache = RaggedCache(3, "cuda", batched=True)
    fed = [[], [], []]
    got = [[], [], []]
    for sizes in [[40, 7, 90], [60, 0, 1], [1, 2, 1], [150, 180, 30]]:
        chunks = [rows[r][len(fed[r]):len(fed[r]) + k] for r, k in enumerate(sizes)]
        ids = torch.tensor([[t for c in chunks for t in c]], device="cuda")
        positions = torch.tensor([[k for f, c in zip(fed, chunks) for k in range(len(f), len(f) + len(c))]], device="cuda")
        hidden = policy.hidden_packed(ids, positions, cache, [len(c) for c in chunks])[0]
        offset = 0
        for r, c in enumerate(chunks):
            got[r].append(hidden[offset:offset + len(c)])
            offset += len(c)
            fed[r].extend(c)
    for r in range(3):
        ids = torch.tensor([fed[r]], device="cuda")
        alone, _ = policy.hidden(ids, torch.ones_like(ids), torch.arange(len(fed[r]), device="cuda")[None])
        assert torch.allclose(torch.cat(got[r]), alone[0], atol=1e-4)

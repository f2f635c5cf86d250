"""Shared fixtures and helpers: real TextWorld games from the textrl cache, the real tiny model, and
the small training configuration with what the training tests read back from a run.

Games and the converted SmolLM2 tokenizer live in the normal textrl cache ($TEXTRL_CACHE or
~/.cache/textrl), so a second run of the suite reuses them; tests that exercise the cache itself
use their own temporary directories. Test modules import the plain helpers (`config`, `SMALL`,
`read_metrics`, `table`, `Snapshot`, `StopAfter`) with `from tests.conftest import ...`.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir

from textrl.config import CONF_DIR, check_renamed_options, load_model_config, register_configs, to_train_config
from textrl.games.pool import GamePool
from textrl.games.prompt import PromptBuilder
from textrl.policy.model import build_policy

register_configs()  # train.yaml's train_schema: a test module run alone composes without textrl.cli.train

SMALL = ["model=tiny", "env.num_envs=4", "env.pool_size=8", "eval.games=4", "eval.batch=4", "eval.transcripts=2",
         "eval.train_games=2", "env.decode_groups=2",  # two groups of two rows: grouped and batched decoding
         "ppo.epochs=2", "ppo.minibatch_size=2", "ppo.grad_accum=2", "trainer.accelerator=cpu",
         # RL alone: the default's warm start and KL anchor have tests of their own
         # (test_warm_start_and_exploration.py, test_group_baselines_and_kl.py, resuming with both in test_training.py)
         "warm_start.steps=0", "ppo.kl_coef=0"]


def config(tmp_path, *overrides):
    # fp32 unless a test picks a memory option: the default (memory=auto) is bf16 on some machines,
    # and the exactness checks (ratio 1 within 1e-4, resumed == straight) are fp32 invariants
    memory = [] if any(o.startswith("memory=") for o in overrides) else ["memory=none"]
    check_renamed_options(list(overrides))  # as python train.py refuses them
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={tmp_path}", *SMALL, *memory, *overrides])
    return to_train_config(cfg)


def read_metrics(run_dir):
    with open(Path(run_dir) / "logs" / "metrics.csv") as f:
        return list(csv.DictReader(f))


TABLE_KEYS = ["iteration", "rollout/return", "rollout/win_rate", "loss/policy", "loss/value", "eval/win_rate",
              "rollout/temperature", "optim/lr_lm", "optim/grad_norm"]


def table(run):
    return [[r[k] and round(float(r[k]), 5) for k in TABLE_KEYS] for r in read_metrics(run)]


class Snapshot(L.Callback):
    """The policy's own weights when training starts (after any checkpoint is loaded)."""

    def on_train_start(self, trainer, pl_module):
        self.weights = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}

    def changed(self, module) -> list[str]:
        after = module.policy.state_dict()
        return [k for k, v in self.weights.items() if not torch.equal(v, after[k])]


class StopAfter(L.Callback):
    """Stops a run after n iterations, cleanly (Lightning still runs its end-of-training hooks)."""

    def __init__(self, n):
        self.n = n

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch + 1 >= self.n:
            trainer.should_stop = True


@pytest.fixture(scope="session")
def easy_pool() -> GamePool:
    return GamePool("easy")


@pytest.fixture(scope="session")
def easy_games(easy_pool):
    """24 held-out easy games."""
    return easy_pool.games("eval", 24)


@pytest.fixture(scope="session")
def tiny():
    """(policy, tokenizer) of the randomly initialised 2-layer model, in eval mode."""
    torch.manual_seed(0)
    policy, tokenizer = build_policy(load_model_config("tiny"))
    policy.eval()
    return policy, tokenizer


@pytest.fixture(scope="session")
def prompts(tiny):
    return PromptBuilder(tiny[1], max_prompt_tokens=4096)


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (tests/test_cuda.py; skipped without one, run by bench/gpu_check.py)")

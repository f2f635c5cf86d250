"""``trainer.deterministic`` (issue 31, item 12): deterministic algorithms for the whole run.

On CUDA, SDPA's and the embedding's backward are nondeterministic unless torch is told otherwise,
so a resumed run continues exactly only with ``trainer.deterministic=true``; on a CPU it always does
(tests/test_training.py, tests/test_preemption.py). No GPU here: this checks that the option
trains (a warm start included, which runs inside the same mode, set before it), that torch trains
and evaluates in deterministic mode with cuBLAS's workspace setting, that the mode does not outlive
the run, and that the key is checked.
"""

import os

import lightning as L
import pytest
import torch
from hydra.errors import ConfigCompositionException

import textrl.cli.train as cli
from tests.conftest import config
from textrl.config import TrainConfig, validate
from textrl.errors import ConfigError


class SeesTorchFlags(L.Callback):
    """What torch's flags are while Lightning trains and evaluates."""

    def __init__(self):
        self.seen = []

    def _record(self):
        self.seen.append((torch.are_deterministic_algorithms_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                          torch.backends.cudnn.benchmark))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._record()

    def on_validation_start(self, trainer, pl_module):
        self._record()


def test_trainer_deterministic_trains_in_deterministic_mode_and_restores_the_flags(tmp_path, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    flags = SeesTorchFlags()
    result = cli.train(config(tmp_path, "trainer.deterministic=true", "iterations=1", "eval.every=1",
                              "eval.before_training=false", "warm_start.steps=1", "warm_start.games=2",
                              "env.max_steps=3"), callbacks=[flags])
    assert result["trainer"].current_epoch == 1 and (tmp_path / "warm_start.json").is_file()
    assert len(flags.seen) == 2 and set(flags.seen) == {(True, ":4096:8", False)}  # the iteration, the evaluation
    # afterwards, the process is as it was: a later run (a test, a joblib worker's next job) is not deterministic
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_deterministic_is_off_by_default_and_checked(tmp_path):
    assert TrainConfig().trainer.deterministic is False
    assert config(tmp_path).trainer.deterministic is False
    assert config(tmp_path, "trainer.deterministic=true").trainer.deterministic is True
    with pytest.raises(ConfigCompositionException):  # typed by the schema
        config(tmp_path, "trainer.deterministic=sometimes")
    cfg = config(tmp_path)
    cfg.trainer.deterministic = "yes"  # a TrainConfig built in Python is not typed by Hydra
    with pytest.raises(ConfigError, match="trainer.deterministic='yes' is not allowed: true or false"):
        validate(cfg)

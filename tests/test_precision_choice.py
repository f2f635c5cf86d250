"""``memory=auto`` on a CPU decides by measurement (issues 32, 69): the faster of fp32 and bf16 autocast
on a forward and backward of the model itself, measured once per machine and cached; one start-up
line names both figures and the choice. The timing itself (``time_training``) is stubbed to either
answer, and run for real once."""

import json
import logging

import pytest
import torch

import textrl.cli.train as cli
import textrl.policy.speed.precision as precision
from textrl.config import ModelFacts, PPOConfig, TrainConfig, TrainerConfig, resolve, validate
from textrl.policy.checkpoint import load
from textrl.policy.speed.precision import autocast_context, choose_precision, linear_shapes
from textrl.training.run import model_facts
from tests.conftest import config


class Timing:
    """A stand-in for ``time_training``: fixed (fp32, bf16) tokens/s, and how often it was asked."""

    def __init__(self, fp32, bf16):
        self.answer, self.calls = (fp32, bf16), 0

    def __call__(self, model, *args, **kwargs):
        assert hasattr(model, "hidden")  # the policy itself reaches the measurement
        self.calls += 1
        return self.answer


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The decisions go to a folder of the test's own, and bf16 autocast counts as available."""
    folder = tmp_path / "precision"
    monkeypatch.setattr(precision, "precision_cache_dir", lambda cache_dir=None: folder)
    monkeypatch.setattr(precision, "cpu_bf16_autocast", lambda: True)
    return folder


def stub(monkeypatch, fp32, bf16) -> Timing:
    timing = Timing(fp32, bf16)
    monkeypatch.setattr(precision, "time_training", timing)
    return timing


@pytest.mark.parametrize("fp32, bf16, expected", [(100.0, 300.0, "bf16-mixed"), (300.0, 100.0, "32-true")])
def test_auto_picks_the_precision_the_measurement_says_is_faster(tiny, cache, monkeypatch, fp32, bf16, expected):
    timing = stub(monkeypatch, fp32, bf16)
    choice = choose_precision(tiny[0], "cpu")
    assert (choice.precision, choice.fp32_tokens_per_s, choice.bf16_tokens_per_s, timing.calls) == (expected, fp32, bf16, 1)
    stored = json.loads(next(cache.glob("*.json")).read_text())
    assert (stored["precision"], stored["fp32_tokens_per_s"], stored["bf16_tokens_per_s"]) == (expected, fp32, bf16)
    assert stored["key"]["threads"] == torch.get_num_threads() and stored["key"]["torch"] == torch.__version__


def test_the_cached_decision_is_reused_and_another_key_measures_again(tiny, cache, monkeypatch):
    timing = stub(monkeypatch, 100.0, 300.0)
    first = choose_precision(tiny[0], "cpu")
    timing.answer = (300.0, 100.0)  # a second measurement would say otherwise
    again = choose_precision(tiny[0], "cpu")
    assert timing.calls == 1 and again.precision == first.precision == "bf16-mixed"
    assert (again.fp32_tokens_per_s, again.bf16_tokens_per_s) == (100.0, 300.0) and "read from" in again.how
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1 if threads == 1 else threads - 1)  # another thread count: another key
    try:
        other = choose_precision(tiny[0], "cpu")
    finally:
        torch.set_num_threads(threads)
    assert timing.calls == 2 and other.precision == "32-true"
    assert len(list(cache.glob("*.json"))) == 2
    assert choose_precision(tiny[0], "cpu").precision == "bf16-mixed" and timing.calls == 2  # the first key's again


@pytest.mark.parametrize("content", ["{not json", '{"precision": "bf16-mixed"}', "[]", ""])
def test_a_corrupt_cache_file_is_measured_again_and_replaced(tiny, cache, monkeypatch, content):
    timing = stub(monkeypatch, 300.0, 100.0)
    choose_precision(tiny[0], "cpu")
    (path,) = cache.glob("*.json")
    path.write_text(content)
    assert choose_precision(tiny[0], "cpu").precision == "32-true" and timing.calls == 2
    assert json.loads(path.read_text())["precision"] == "32-true"  # replaced by a readable one
    assert choose_precision(tiny[0], "cpu").precision == "32-true" and timing.calls == 2
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left behind


def test_a_busy_cpu_decides_on_one_thread_and_caches_nothing(tiny, cache, monkeypatch):
    timing = stub(monkeypatch, 100.0, 300.0)
    monkeypatch.setattr(precision, "_others_cpu_seconds", lambda *args: 1e6)  # other processes on every core
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        choice = choose_precision(tiny[0], "cpu")
        assert torch.get_num_threads() == 2  # restored after the one-thread measurement
    finally:
        torch.set_num_threads(threads)
    assert choice.precision == "bf16-mixed" and timing.calls == 2 and "not cached" in choice.how
    assert not list(cache.glob("*.json"))


def test_forced_precisions_and_cuda_are_not_measured(tiny, cache, monkeypatch, tmp_path):
    timing = stub(monkeypatch, 100.0, 300.0)
    for memory, expected in [("none", "32-true"), ("bf16", "bf16-mixed")]:
        cfg = config(tmp_path, f"memory={memory}")
        cfg = resolve(cfg, model_facts(cfg, tiny[0], torch.device("cpu"), None))
        assert (cfg.memory.precision, cfg.ppo.recompute_old) == (expected, expected != "32-true")
    for native in (True, False):  # CUDA: bf16 where the GPU computes it natively, as before
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # "cuda": the current GPU's capability
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda i=None, n=native: {1: (8, 0) if n else (7, 5), 0: (7, 5) if n else (8, 0)}[i])
        assert choose_precision(tiny[0], "cuda").precision == ("bf16-mixed" if native else "32-true")
    monkeypatch.setattr(precision, "cpu_bf16_autocast", lambda: False)  # no bf16 autocast at all: fp32
    choice = choose_precision(tiny[0], "cpu")
    assert (choice.precision, choice.fp32_tokens_per_s) == ("32-true", None)
    assert timing.calls == 0 and not cache.exists()


def test_resolve_leaves_auto_to_the_measurement_on_a_cpu(tiny, cache, monkeypatch):
    timing = stub(monkeypatch, 300.0, 100.0)
    cfg = resolve(validate(TrainConfig(output_dir="/tmp/unused", trainer=TrainerConfig(accelerator="cpu"))))
    assert (cfg.memory.precision, cfg.ppo.recompute_old) == ("auto", None)
    cfg = resolve(cfg, ModelFacts(tiny[0].position_limit, lambda: choose_precision(tiny[0], "cpu").precision))
    assert (cfg.memory.precision, cfg.ppo.recompute_old, timing.calls) == ("32-true", False, 1)
    cfg = resolve(validate(TrainConfig(output_dir="/tmp/unused", trainer=TrainerConfig(accelerator="cpu"),
                                       ppo=PPOConfig(recompute_old=True))))
    cfg = resolve(cfg, ModelFacts(tiny[0].position_limit, lambda: choose_precision(tiny[0], "cpu").precision))
    assert (cfg.memory.precision, cfg.ppo.recompute_old) == ("32-true", True)  # an explicit value stays


def test_the_cli_autocast_decides_auto_as_training_does(tiny, cache, monkeypatch):
    timing = stub(monkeypatch, 100.0, 300.0)
    with autocast_context("auto", "cpu", tiny[0]):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    timing.answer = (300.0, 100.0)
    with autocast_context("auto", "cpu", tiny[0]):  # the cached decision: the same autocast
        assert torch.is_autocast_enabled("cpu")
    with autocast_context("32-true", "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    assert timing.calls == 1
    with pytest.raises(ValueError, match="decided on the model"):
        autocast_context("auto", "cpu")


def test_the_shapes_are_the_models_linear_layers_without_its_head(tiny):
    policy = tiny[0]
    shapes = linear_shapes(policy)
    head = policy.lm.get_output_embeddings()
    linears = [m for m in policy.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    assert sum(shapes.values()) == len(linears) and (head.in_features, head.out_features) not in shapes


def test_the_measurement_is_a_forward_and_backward_that_leaves_nothing_behind(tiny):
    """``time_training`` runs the policy's forward and the backward into its trainable weights in each
    precision, and leaves no gradient, the mode and the random state as they were."""
    policy = tiny[0]
    policy.train()
    state = torch.random.get_rng_state()
    calls = []
    top = [p for p in policy.lm.parameters() if p.requires_grad][-1]
    hook = top.register_hook(lambda grad: calls.append(grad.dtype))
    try:
        fp32, bf16 = precision.time_training(policy, tokens=16, repeats=1)
    finally:
        hook.remove()
    assert fp32 > 0 and bf16 > 0 and policy.training
    assert all(p.grad is None for p in policy.parameters()) and torch.equal(torch.random.get_rng_state(), state)
    assert calls == [torch.float32] * 4  # a backward per precision per round (warm-up, timed) into the fp32 weight


def test_training_decides_at_start_and_logs_both_figures_and_the_choice(tmp_path, cache, monkeypatch, caplog):
    timing = stub(monkeypatch, 123.4, 567.8)
    cfg = config(tmp_path, "memory=auto", "iterations=1", "eval.before_training=false", "eval.games=2",
                 "eval.batch=2", "eval.train_games=0", "eval.transcripts=0")
    assert (cfg.memory.precision, cfg.ppo.recompute_old) == ("auto", None)  # resolve left them to the measurement
    caplog.set_level(logging.INFO, logger="textrl.training.run")
    result = cli.train(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "textrl.training.run" and r.getMessage().startswith("memory=")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("memory=auto: precision bf16-mixed: ")
    assert "123.4 tokens/s in fp32" in lines[0] and "567.8 tokens/s under bf16 autocast" in lines[0]
    assert timing.calls == 1
    assert result["trainer"].precision == "bf16-mixed" and result["module"].cfg.ppo.recompute_old is True
    saved = load(result["last"])["textrl"]["config"]  # what textrl-eval and textrl-play read back
    assert (saved["memory"]["precision"], saved["ppo"]["recompute_old"]) == ("bf16-mixed", True)

    # resumed, it keeps the checkpoint's precision whatever this machine would measure now; the
    # ranks DDP starts would read it from the environment, which the run leaves clean
    opposite = stub(monkeypatch, 567.8, 123.4)
    resumed = cli.train(config(tmp_path, "memory=auto", "iterations=2", "eval.before_training=false", "eval.games=2",
                               "eval.batch=2", "eval.train_games=0", "eval.transcripts=0"))
    assert opposite.calls == 0
    assert resumed["trainer"].precision == "bf16-mixed" and resumed["trainer"].current_epoch == 2
    assert precision.AUTO_PRECISION_ENV not in __import__("os").environ


def test_a_rank_started_with_rank_0s_decision_takes_it_without_measuring(tiny, cache, monkeypatch):
    policy, _ = tiny
    timing = stub(monkeypatch, 300.0, 100.0)
    cfg = validate(TrainConfig(trainer=TrainerConfig(accelerator="cpu")))
    cfg = resolve(resolve(cfg), model_facts(cfg, policy, torch.device("cpu"), decided="bf16-mixed"))
    assert (cfg.memory.precision, cfg.ppo.recompute_old, timing.calls) == ("bf16-mixed", True, 0)

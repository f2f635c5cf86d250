"""A non-finite loss or gradient never reaches the weights, and non-finite weights never reach a
checkpoint: real runs of the tiny model on real games, with NaN injected into the loss of chosen
optimizer steps (the PPO update's own loss, multiplied by NaN before backward)."""

import lightning as L
import pytest
import torch

import textrl.cli.train as cli
import textrl.training.warm_start as ws
from textrl.errors import NonFiniteError
from textrl.policy.checkpoint import load
from textrl.ppo.update import PPOUpdate
from tests.conftest import config, read_metrics


class NaNLoss(L.Callback):
    """Multiplies the PPO loss by NaN in the iterations listed (1-based), from their ``first``-th
    minibatch on (``only``: that minibatch alone)."""

    def __init__(self, monkeypatch, iterations: set[int], first: int = 1, only: bool = False):
        self.iterations, self.first, self.only = iterations, first, only
        self.iteration, self.calls = 0, 0
        real = PPOUpdate.loss

        def loss(update, minibatch, data, normalizer, **kw):
            terms, fed = real(update, minibatch, data, normalizer, **kw)
            self.calls += 1
            hit = self.calls == self.first if self.only else self.calls >= self.first
            if self.iteration in self.iterations and hit:
                terms.loss = terms.loss * float("nan")
            return terms, fed

        monkeypatch.setattr(PPOUpdate, "loss", loss)

    def on_train_epoch_start(self, trainer, pl_module):
        self.iteration, self.calls = trainer.current_epoch + 1, 0


class Weights(L.Callback):
    """The policy's weights after each iteration (as last.ckpt saves them)."""

    def __init__(self):
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_epoch_end(self, trainer, pl_module):
        self.after[trainer.current_epoch + 1] = {k: v.detach().clone() for k, v in pl_module.policy.state_dict().items()}


def test_a_step_with_a_nan_loss_is_skipped_and_counted_and_the_run_goes_on(tmp_path, monkeypatch):
    nan = NaNLoss(monkeypatch, iterations={1}, first=1, only=True)  # the first minibatch of iteration 1
    weights = Weights()
    result = cli.train(config(tmp_path, "iterations=2", "eval.every=2"), callbacks=[nan, weights])
    rows = [r for r in read_metrics(tmp_path) if r.get("loss/policy")]
    assert [float(r["optim/skipped_steps"]) for r in rows] == [1.0, 0.0]
    assert all(float(r["loss/policy"]) == float(r["loss/policy"]) for r in rows)  # the skipped step's NaN is not logged
    assert all(bool(v.isfinite().all()) for v in weights.after[2].values() if v.is_floating_point())
    assert load(result["last"])["textrl"]["iterations_done"] == 2


def test_nan_steps_in_a_row_stop_the_run_before_its_checkpoint(tmp_path, monkeypatch):
    nan = NaNLoss(monkeypatch, iterations={2})  # every minibatch of iteration 2
    weights = Weights()
    cfg = config(tmp_path, "iterations=3", "eval.every=3", "ppo.max_skipped_steps=2")
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row"):
        cli.train(cfg, callbacks=[nan, weights])
    saved = load(tmp_path / "checkpoints" / "last.ckpt")
    assert saved["textrl"]["iterations_done"] == 1  # iteration 2 wrote nothing
    state = {k.removeprefix("policy."): v for k, v in saved["state_dict"].items() if k.startswith("policy.")}
    assert state and all(torch.equal(v, weights.after[1][k]) for k, v in state.items())
    assert all(bool(v.isfinite().all()) for v in state.values() if v.is_floating_point())


def test_the_warm_start_skips_nan_steps_and_stops_on_too_many(tmp_path, monkeypatch):
    from textrl.policy.model import build_policy

    cfg = config(tmp_path, "warm_start.steps=4", "warm_start.games=4", "ppo.max_skipped_steps=3")
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    before = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    real = ws._decision_logprobs
    monkeypatch.setattr(ws, "_decision_logprobs", lambda *a: real(*a) * float("nan"))
    with pytest.raises(NonFiniteError, match="warm start: 3 optimizer steps in a row"):
        ws.warm_start(policy, tokenizer, cfg)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())  # nothing reached the weights


def scaled_update(tmp_path, easy_pool, max_skipped=3):
    """A real rollout of 4 games and a PPO update told that an fp16 loss scaler runs
    (``Runtime.loss_scale``), with the optimizer's steps counted and not applied (the scaler's
    ``step`` would skip them too): (policy, update, episodes, optimizer, steps taken)."""
    from textrl.policy.decoding import ConstrainedDecoder
    from textrl.policy.memory import make_optimizer
    from textrl.policy.model import build_policy
    from textrl.ppo.update import Runtime
    from textrl.rollout import Player, Sampling, episode_seeds, play_games

    cfg = config(tmp_path, "env.max_steps=4", "ppo.grad_accum=1", f"ppo.max_skipped_steps={max_skipped}")
    torch.manual_seed(0)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy, batched=False) for _ in range(2)])
    games = easy_pool.games("train", 4)
    episodes, _ = play_games(player, games, cfg.env, Sampling(1.0, episode_seeds(0, 0, games)))
    update = PPOUpdate(policy, cfg.ppo, tokenizer.pad_token_id, cfg.seed, runtime=Runtime(loss_scale=lambda: 1024.0))
    optimizer = make_optimizer([q for q in policy.lm.parameters() if q.requires_grad],
                               list(policy.value_head.parameters()), cfg.memory, 1e-3, 1e-3, 0.0)
    steps = []
    optimizer.step = lambda *a, **k: steps.append(1)
    return policy, update, episodes, optimizer, steps


def test_under_fp16_scaling_a_persistent_nan_loss_stops_the_update(tmp_path, easy_pool, monkeypatch):
    # the scaler would skip these steps forever while its scale collapses: they count toward the limit
    NaNLoss(monkeypatch, iterations={0})
    policy, update, episodes, optimizer, steps = scaled_update(tmp_path, easy_pool)
    with pytest.raises(NonFiniteError, match="PPO update: 3 optimizer steps in a row had a non-finite loss"):
        update.run(episodes, 0, optimizer)
    assert steps == []  # not one of them was handed to the optimizer


def test_under_fp16_scaling_an_overflowed_gradient_is_the_scalers_to_skip(tmp_path, easy_pool):
    # a finite loss whose (scaled) gradient is not finite: the step goes to the scaler, which skips it
    # and lowers its scale; it is counted as skipped and does not stop the run
    policy, update, episodes, optimizer, steps = scaled_update(tmp_path, easy_pool, max_skipped=1)
    for q in policy.value_head.parameters():
        q.register_hook(lambda g: g * float("inf"))
    stats = update.run(episodes, 0, optimizer)
    planned = len(update.prepare(episodes, 0).steps)
    assert len(steps) == planned == stats.skipped_steps and stats.steps == 0

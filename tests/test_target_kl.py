"""ppo.target_kl stops an update once its policy has moved past the target, on a real rollout of
real games and the tiny model: the step whose forwards saw the policy past the target is not taken,
nor any later one, and ``optim/steps_share`` says how far the update went."""

import pytest
import torch

from tests.conftest import config
from textrl.config import register_configs
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.memory import make_optimizer
from textrl.policy.model import build_policy
from textrl.ppo.update import PPOUpdate
from textrl.rollout import Player, Sampling, episode_seeds, play_games

register_configs()


def update_once(tmp_path, easy_pool, *overrides):
    """One update on 4 real episodes, with a large learning rate (one step moves the policy) and an
    optimizer step per episode: (its stats, the optimizer steps planned, the optimizer steps taken)."""
    cfg = config(tmp_path, "env.max_steps=4", "ppo.lr_lm=0.01", "ppo.grad_accum=1", *overrides)
    torch.manual_seed(0)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy, batched=False) for _ in range(2)])
    games = easy_pool.games("train", 4)
    episodes, _ = play_games(player, games, cfg.env, Sampling(1.0, episode_seeds(0, 0, games)))
    update = PPOUpdate(policy, cfg.ppo, tokenizer.pad_token_id, cfg.seed)
    optimizer = make_optimizer([q for q in policy.lm.parameters() if q.requires_grad],
                               list(policy.value_head.parameters()), cfg.memory, cfg.ppo.lr_lm, cfg.ppo.lr_value, 0.0)
    taken = []
    step = optimizer.step
    optimizer.step = lambda *a, **k: (taken.append(1), step(*a, **k))[1]  # counts the steps the update takes
    planned = len(update.prepare(episodes, 0).steps)
    policy.train()
    return update.run(episodes, 0, optimizer), planned, len(taken)


def test_without_a_target_every_planned_step_is_taken(tmp_path, easy_pool):
    stats, planned, taken = update_once(tmp_path, easy_pool)
    assert planned >= 4 and taken == planned == stats.steps
    assert "optim/steps_share" not in stats.metrics()


def test_a_step_that_sees_the_policy_past_the_target_stops_the_update(tmp_path, easy_pool):
    # the first step's forwards see the rollout's own weights (approx_kl ~1e-12 in fp32): taken;
    # the second sees the weights one step of lr 0.01 moved, far past 1e-6: it and the rest are not
    stats, planned, taken = update_once(tmp_path, easy_pool, "ppo.target_kl=1e-6")
    assert planned >= 4 and taken == stats.steps == 1
    assert stats.metrics()["optim/steps_share"] == pytest.approx(1 / planned)


def test_a_target_the_update_never_reaches_takes_every_step(tmp_path, easy_pool):
    stats, planned, taken = update_once(tmp_path, easy_pool, "ppo.target_kl=1000")
    assert taken == planned == stats.steps
    assert stats.metrics()["optim/steps_share"] == 1.0

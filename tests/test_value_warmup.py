"""ppo.value_warmup: the first iterations fit the value head alone on real rollouts of real games with
the tiny model: the LM's weights and optimizer state stay exactly as they were, the value head moves,
and the LM's learning-rate schedule starts at the first iteration that steps it."""

import pytest
import torch

from tests.conftest import config
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.memory import make_optimizer
from textrl.policy.model import build_policy
from textrl.ppo.update import PPOUpdate
from textrl.rollout import Player, Sampling, episode_seeds, play_games
from textrl.training.module import PPOModule, lr_factor


def lm_and_value(policy):
    return ({n: q.detach().clone() for n, q in policy.lm.named_parameters()},
            {n: q.detach().clone() for n, q in policy.value_head.named_parameters()})


def changed(before, module):
    return [n for n, q in module.named_parameters() if not torch.equal(q, before[n])]


def test_warmup_iterations_fit_the_value_head_alone_then_the_lm_steps(tmp_path, easy_pool):
    cfg = config(tmp_path, "env.max_steps=4", "ppo.value_warmup=1", "ppo.grad_accum=1", "ppo.lr_lm=0.01")
    torch.manual_seed(0)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy, batched=False) for _ in range(2)])
    update = PPOUpdate(policy, cfg.ppo, tokenizer.pad_token_id, cfg.seed)
    optimizer = make_optimizer([q for q in policy.lm.parameters() if q.requires_grad],
                               list(policy.value_head.parameters()), cfg.memory, cfg.ppo.lr_lm, cfg.ppo.lr_value, 0.0)
    games = easy_pool.games("train", 4)

    for iteration in (0, 1):
        episodes, _ = play_games(player, games, cfg.env, Sampling(1.0, episode_seeds(0, iteration, games)))
        lm, value = lm_and_value(policy)
        policy.train()
        stats = update.run(episodes, iteration, optimizer)
        policy.eval()
        assert stats.steps >= 4
        assert changed(value, policy.value_head) == list(value)  # the critic fits in both
        if iteration == 0:  # warm-up: not one LM weight moved, and its optimizer holds no state
            assert changed(lm, policy.lm) == []
            assert all(not optimizer.state[q] for q in optimizer.param_groups[0]["params"])
            assert stats.metrics()["optim/grad_norm"] == 0
        else:
            assert len(changed(lm, policy.lm)) > 0
            assert stats.metrics()["optim/grad_norm"] > 0


def test_the_lm_schedule_starts_when_the_lm_first_steps(tmp_path):
    cfg = config(tmp_path, "iterations=6", "ppo.value_warmup=2", "ppo.lr_lm=1e-4", "ppo.lr_lm_min=1e-5")
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    module = PPOModule(cfg, policy, tokenizer)
    [optimizer], [scheduler] = module.configure_optimizers()
    rates = []
    for _ in range(6):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradient: nothing moves, in the order torch expects
        scheduler.step()
    module.teardown("fit")
    assert rates[:3] == [pytest.approx(1e-4)] * 3  # two warm-up iterations, then the schedule's first
    assert rates[3:] == [pytest.approx(1e-4 * lr_factor(i, 4, 0.1)) for i in (1, 2, 3)]
    assert rates[-1] == pytest.approx(1e-5)

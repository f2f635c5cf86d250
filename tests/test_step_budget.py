"""ppo.step_budget: a training rollout's episode ends, not won, after budget x its walkthrough's
length in commands (Meow-Tea-Taro's exploration budget), with nothing after it to bootstrap;
evaluation plays to env.max_steps."""

import json
import math
from dataclasses import replace

import pytest
import torch

import textrl.cli.train as cli
import textrl.training.module as module
from textrl.config import load_env_config, load_model_config
from textrl.errors import ConfigError
from textrl.games.env import open_game
from textrl.games.pool import GamePool, GameSpec
from textrl.games.workers import GameWorkers
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.model import build_policy
from textrl.rollout import Player, Sampling, episode_seeds, play_games
from tests.conftest import config, read_metrics


@pytest.fixture(scope="module")
def medium():
    env = load_env_config("medium")
    return env, GamePool(GameSpec.from_env(env)).games("train", 4)


def test_the_budget_ends_a_looping_episode_as_not_won_with_nothing_to_bootstrap(medium):
    env, (path, *_) = medium
    game = open_game(path, env, budget=1.5)
    try:
        game.reset()
        limit = math.ceil(1.5 * len(game.walkthrough))
        assert 1 < limit < env.max_steps and game.limit == limit
        results = [game.step("look") for _ in range(limit)]
        assert [r.terminated for r in results] == [False] * (limit - 1) + [True]
        assert not any(r.truncated for r in results)  # truncated would bootstrap from the cut state
        assert not game.observation.won and not game.observation.lost
        assert [r.reward for r in results] == pytest.approx([-env.step_penalty] * limit)  # no loss cost
        with pytest.raises(RuntimeError, match="reset"):
            game.step("look")
        game.reset()  # the walkthrough itself wins within any budget >= 1
        results = [game.step(c) for c in game.walkthrough]
        assert game.observation.won and results[-1].terminated
    finally:
        game.close()


def test_without_a_budget_or_above_the_step_limit_the_game_truncates_at_max_steps(medium):
    env, (path, *_) = medium
    for budget in (None, 1000.0):
        game = open_game(path, replace(env, max_steps=12), budget=budget)
        try:
            game.reset()
            results = [game.step("look") for _ in range(12)]
            assert results[-1].truncated and not any(r.terminated for r in results)
        finally:
            game.close()


@pytest.mark.parametrize("step_workers", [0, 2])
def test_a_sampled_rollout_with_a_budget_is_cut_at_it_in_process_and_on_workers(medium, step_workers):
    env, games = medium
    torch.manual_seed(0)
    policy, tokenizer = build_policy(load_model_config("tiny"))
    workers = GameWorkers(step_workers) if step_workers else None
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy)], workers=workers)
    try:
        sampling = Sampling(1.0, episode_seeds(0, 0, games))
        cut, _ = play_games(player, games, env, sampling, budget=1.0)
        whole, _ = play_games(player, games, replace(env, max_steps=12), sampling)
    finally:
        player.close()
    for e in cut:
        assert e.length <= len(e.walkthrough)
        assert e.won or (e.length == len(e.walkthrough) and not e.truncated and e.bootstrap_value is None)
    assert any(not e.won for e in cut)  # the untrained policy is cut, else the check above is empty
    assert max(e.length for e in whole) > max(len(e.walkthrough) for e in whole)  # no budget: it plays on


def test_training_rollouts_are_cut_and_the_evaluation_plays_to_max_steps(tmp_path, monkeypatch):
    budgets = {"sampled": set(), "greedy": set()}  # what each kind of play_games call was given
    real_play = module.play_games

    def play_games(player, games, env, sampling=None, budget=None):
        budgets["greedy" if sampling is None else "sampled"].add(budget)
        return real_play(player, games, env, sampling, budget)

    monkeypatch.setattr(module, "play_games", play_games)
    run = cli.train(config(tmp_path, "iterations=1", "ppo.step_budget=1", "eval.before_training=false"))
    assert budgets == {"sampled": {1.0}, "greedy": {None}}  # the training rollout, the evaluation
    rollouts = [r for r in read_metrics(run["run_dir"]) if r["rollout/episode_len"]]
    longest = 0
    for path in GamePool("easy").games("train", 8):  # the run's pool (env.pool_size=8)
        game = open_game(path, load_env_config("easy"))
        game.reset()
        longest = max(longest, len(game.walkthrough))
        game.close()
    assert rollouts and float(rollouts[0]["rollout/episode_len"]) <= longest
    evaluation = json.loads((tmp_path / "evaluation" / "iter_0001.json").read_text())
    lost = [g["steps"] for g in evaluation["per_game"] if not g["won"]]
    assert lost and all(steps == evaluation["max_steps"] for steps in lost)


def test_a_budget_below_one_walkthrough_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="ppo.step_budget"):
        cli.train(config(tmp_path, "ppo.step_budget=0.5"))

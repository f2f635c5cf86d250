"""env.repeat_penalty: a command played again from the same state costs more, in training rollouts only."""

from dataclasses import replace

import pytest

import textrl.cli.train as cli
from textrl.config import ConfigError, load_env_config
from textrl.games.env import open_game
from textrl.games.pool import GamePool, GameSpec
from textrl.rollout import Sampling, episode_seeds, play_games
from tests.conftest import config, read_metrics
from tests.test_config import compose_train

REVERSE = {"north": "south", "south": "north", "east": "west", "west": "east"}


def test_a_command_played_again_from_the_same_state_costs_the_penalty():
    env = load_env_config("medium")
    (path,) = GamePool(GameSpec.from_env(env)).games("train", 1)
    penalised, plain = open_game(path, replace(env, repeat_penalty=0.5)), open_game(path, env)
    try:
        penalised.reset()
        plain.reset()
        move = next(c for c in penalised.observation.admissible_commands if c.startswith("go "))
        back = "go " + REVERSE[move.split()[1]]
        # away and back twice: the second round plays both commands again from the same two states
        extra = [penalised.step(c).reward - plain.step(c).reward for c in [move, back, move, back]]
        assert extra == pytest.approx([0.0, 0.0, -0.5, -0.5])
        # the same command from another state is new: "look" in the start room, then in the other one
        assert penalised.step("look").reward == pytest.approx(plain.step("look").reward)
        penalised.step(move), plain.step(move)
        assert penalised.step("look").reward == pytest.approx(plain.step("look").reward)
        # a new episode starts with nothing played
        penalised.reset()
        plain.reset()
        assert penalised.step(move).reward == pytest.approx(plain.step(move).reward)
    finally:
        penalised.close()
        plain.close()


def test_the_penalty_must_be_a_number_at_least_0():
    with pytest.raises(ConfigError, match="env.repeat_penalty=-0.1 is not allowed: a number >= 0"):
        compose_train(["env.repeat_penalty=-0.1"])


def test_training_rollouts_pay_for_each_repeat_and_evaluation_never_does(tmp_path):
    # the rule (env.block_repeats, on by default on easy) leaves nothing to repeat: the penalty is for play without it
    result = cli.train(config(tmp_path, "iterations=1", "env.repeat_penalty=0.3", "env.block_repeats=false"))
    module = result["module"]
    held_out, _ = module._eval_episodes  # the last evaluation's episodes
    rows = read_metrics(tmp_path)
    last = [r for r in rows if r.get("eval/return")][-1]
    # the evaluation's logged return is the games' own: score change, win bonus, step penalty
    own = [(1.0 + module.cfg.env.win_bonus) * e.won - module.cfg.env.step_penalty * e.length for e in held_out]
    assert float(last["eval/return"]) == pytest.approx(sum(own) / len(own), abs=1e-5)
    turns = sum(e.length for e in held_out)
    assert float(last["eval/repeats"]) == pytest.approx(sum(e.repeats for e in held_out) / turns)
    assert "rollout/repeats" in [k for r in rows for k, v in r.items() if v]
    # a training rollout: each episode's return is the plain game's minus 0.3 per repeat it counts
    curriculum = result["trainer"].datamodule.curriculum
    games = curriculum.games(0).games
    episodes, _ = play_games(module.player, games, curriculum.env, Sampling(1.0, episode_seeds(0, 0, games)))
    assert sum(e.repeats for e in episodes) > 0  # else the check below would hold without the penalty
    for path, episode in zip(games, episodes):
        plain = open_game(path, module.cfg.env.for_evaluation())
        try:
            plain.reset()
            plain_return = sum(plain.step(s.action.command).reward for s in episode.steps)
        finally:
            plain.close()
        assert episode.total_return == pytest.approx(plain_return - 0.3 * episode.repeats)

"""rollout/repeats and eval/repeats: the share of turns that play a command already played from the
same state earlier in the episode, how a loop shows."""

import pytest

import textrl.cli.train as cli
from textrl.config import load_env_config
from textrl.games.env import open_game
from textrl.games.pool import GamePool, GameSpec
from textrl.rollout import replay_commands
from tests.conftest import config, read_metrics

REVERSE = {"north": "south", "south": "north", "east": "west", "west": "east"}


def test_an_episode_counts_the_commands_played_again_from_the_same_state(prompts):
    env = load_env_config("medium")  # every command offered (no env.block_repeats): a loop can be played
    (path,) = GamePool(GameSpec.from_env(env)).games("train", 1)
    game = open_game(path, env)
    try:
        move = next(c for c in game.reset().admissible_commands if c.startswith("go "))
        back = "go " + REVERSE[move.split()[1]]
        # away and back twice: the second round plays both commands again from the same two states;
        # "look" in the start room, then in the other one, is new each time
        episode = replay_commands(game, prompts, [move, back, move, back, "look", move, "look"])
    finally:
        game.close()
    assert episode.length == 7 and episode.repeats == 3  # the second move, the second back, the third move


def test_training_and_evaluation_log_the_share_of_repeated_turns(tmp_path):
    # every command offered (no env.block_repeats, which offers a repeat only once all were played)
    result = cli.train(config(tmp_path, "iterations=1"))
    held_out, _ = result["module"]._eval_episodes  # the last evaluation's episodes
    rows = read_metrics(tmp_path)
    last = [r for r in rows if r.get("eval/repeats")][-1]
    turns = sum(e.length for e in held_out)
    assert float(last["eval/repeats"]) == pytest.approx(sum(e.repeats for e in held_out) / turns)
    assert "rollout/repeats" in [k for r in rows for k, v in r.items() if v]

"""env.block_repeats: a state offers only the commands played fewest times from it in the episode
(a command already played is not offered while another is left), in training rollouts and evaluation
alike; off by default, and textrl-eval plays any checkpoint with it or without it."""

from collections import Counter
from dataclasses import replace

import json

import pytest
import torch

import textrl.cli.train as cli
from textrl.cli.evaluate import evaluate, main
from textrl.config import load_env_config, load_model_config
from textrl.games.env import InvalidCommandError, open_game
from textrl.games.pool import GamePool, GameSpec
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.model import build_policy
from textrl.rollout import Player, play_games
from tests.conftest import config

REVERSE = {"north": "south", "south": "north", "east": "west", "west": "east"}


@pytest.fixture(scope="module")
def medium_game():
    env = load_env_config("medium")
    (path,) = GamePool(GameSpec.from_env(env)).games("train", 1)
    return env, path


def test_a_command_played_from_a_state_is_not_offered_there_again(medium_game):
    env, path = medium_game
    blocked, plain = open_game(path, replace(env, block_repeats=True)), open_game(path, env)
    try:
        start = blocked.reset().admissible_commands
        assert start == plain.reset().admissible_commands  # nothing played yet: all of them
        move = next(c for c in start if c.startswith("go "))
        back = "go " + REVERSE[move.split()[1]]
        there = blocked.step(move).observation.admissible_commands
        assert there == plain.step(move).observation.admissible_commands  # a state not seen before
        # back in the start room: the command that left it is not offered again, the others are
        home = blocked.step(back).observation.admissible_commands
        assert home == [c for c in plain.step(back).observation.admissible_commands if c != move]
        with pytest.raises(InvalidCommandError, match="not admissible here"):
            blocked.step(move)
        # "look" leaves the room as it was: now two commands were played from it
        assert blocked.step("look").observation.admissible_commands == [
            c for c in plain.step("look").observation.admissible_commands if c not in (move, "look")]
        # a new episode starts with nothing played
        assert blocked.reset().admissible_commands == plain.reset().admissible_commands
    finally:
        blocked.close()
        plain.close()


def test_a_state_whose_every_command_was_played_offers_those_played_least(medium_game):
    env, path = medium_game
    blocked, plain = open_game(path, replace(env, block_repeats=True)), open_game(path, env)
    try:
        start = blocked.reset()
        plain.reset()
        move = next(c for c in start.admissible_commands if c.startswith("go "))
        back = "go " + REVERSE[move.split()[1]]
        blocked.step(move)
        plain.step(move)
        # every command of the start room played from it once (what a long episode can come to)
        for command in start.admissible_commands:
            blocked._played[(*start.state, command)] = 1
        home = blocked.step(back).observation
        everything = plain.step(back).observation.admissible_commands
        assert home.state == start.state
        assert home.admissible_commands == everything  # each played once: all of them again
        # a second round takes each command in turn: "look" (the room unchanged) is not offered
        # again until the others were played twice too. Offering all of them let a trained
        # policy play "look" to the step limit (bench/results/medium_block_repeats/)
        after_look = blocked.step("look")
        plain.step("look")
        assert after_look.observation.state == start.state
        assert after_look.observation.admissible_commands == [c for c in everything if c != "look"]
        assert blocked.step(move).reward == pytest.approx(plain.step(move).reward)  # and the episode goes on
    finally:
        blocked.close()
        plain.close()


def test_a_policy_plays_with_the_rule_wherever_it_is_shown_games():
    medium, trained = load_env_config("medium"), replace(load_env_config("easy"), block_repeats=True)
    assert not medium.block_repeats and not load_env_config("easy").block_repeats
    # another setting's games played by a policy trained with it (textrl-eval, curriculum stages)
    assert medium.with_prompt_of(trained).block_repeats
    assert not load_env_config("easy").with_prompt_of(medium).block_repeats


def needless_repeats(episode) -> int:
    """Turns that play a command played more times from their state than another command offered
    there: what the rule forbids (it offers only the fewest-played)."""
    times, count = Counter(), 0
    for step in episode.steps:
        state = step.observation.state
        least = min(times[(*state, c)] for c in step.observation.admissible_commands)
        count += times[(*state, step.action.command)] > least
        times[(*state, step.action.command)] += 1
    return count


def test_greedy_play_repeats_only_where_nothing_else_is_left():
    torch.manual_seed(0)
    env = replace(load_env_config("medium"), max_steps=24)
    policy, tokenizer = build_policy(load_model_config("tiny"))
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy)])
    games = GamePool(GameSpec.from_env(env)).games("eval", 4)
    plain, _ = play_games(player, games, env)
    blocked, _ = play_games(player, games, replace(env, block_repeats=True))
    assert sum(map(needless_repeats, plain)) > 0  # the untrained greedy policy loops
    assert sum(map(needless_repeats, blocked)) == 0
    assert sum(e.repeats for e in blocked) < sum(e.repeats for e in plain)


def test_textrl_eval_plays_with_the_rule_when_asked():
    summary, episodes, _ = evaluate("random", "medium", games=4, max_steps=32, block_repeats=True)
    assert summary["block_repeats"] is True
    assert sum(map(needless_repeats, episodes)) == 0
    summary, episodes, _ = evaluate("random", "medium", games=4, max_steps=32)
    assert summary["block_repeats"] is False
    assert sum(map(needless_repeats, episodes)) > 0  # else the check above would hold without the rule
    assert evaluate("random", "easy", games=1)[0]["block_repeats"] is False  # the default: the game as it is


@pytest.fixture(scope="module")
def trained_with_the_rule(tmp_path_factory):
    run = tmp_path_factory.mktemp("rule")
    return cli.train(config(run, "iterations=1", "env.block_repeats=true", "eval.before_training=false"))["last"]


def played(tmp_path, name, *args) -> dict:
    """textrl-eval on 4 medium games (24 steps): its results.json."""
    out = tmp_path / name
    assert main([*args, "--env", "medium", "--games", "4", "--max-steps", "24", "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def test_textrl_eval_plays_a_checkpoint_with_or_without_the_rule_whichever_way_it_was_trained(
        trained_with_the_rule, tmp_path, capsys):
    """As trained by default; --no-block-repeats plays the game as it is, --block-repeats the rule;
    results.json says which, and the play is what it says (a greedy loop repeats only without it)."""
    ckpt = trained_with_the_rule
    as_trained = played(tmp_path, "as_trained", "--checkpoint", ckpt)
    assert as_trained["block_repeats"] is True and "not the game as it is" in capsys.readouterr().out
    game = played(tmp_path, "game", "--checkpoint", ckpt, "--no-block-repeats")
    assert game["block_repeats"] is False and "not the game as it is" not in capsys.readouterr().out
    assert played(tmp_path, "ruled", "--checkpoint", ckpt, "--block-repeats")["per_game"] == as_trained["per_game"]
    _, ruled = evaluate(f"checkpoint:{ckpt}", "medium", games=4, max_steps=24)[:2]
    _, plain = evaluate(f"checkpoint:{ckpt}", "medium", games=4, max_steps=24, block_repeats=False)[:2]
    assert sum(map(needless_repeats, ruled)) == 0 < sum(map(needless_repeats, plain))


def test_textrl_eval_plays_a_checkpoint_trained_without_the_rule_with_it_when_asked(tmp_path):
    plain = cli.train(config(tmp_path / "plain", "iterations=1", "eval.before_training=false"))["last"]
    assert played(tmp_path, "as_trained", "--checkpoint", plain)["block_repeats"] is False
    assert played(tmp_path, "ruled", "--checkpoint", plain, "--block-repeats")["block_repeats"] is True

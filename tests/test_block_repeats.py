"""env.block_repeats: a state offers only the commands played fewest times from it in the episode
(a command already played is not offered while another is left), in training rollouts and evaluation
alike."""

from collections import Counter
from dataclasses import replace

import pytest
import torch

from textrl.cli.evaluate import evaluate
from textrl.config import load_env_config, load_model_config
from textrl.games.env import InvalidCommandError, open_game
from textrl.games.pool import GamePool, GameSpec
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.model import build_policy
from textrl.rollout import Player, play_games

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
    medium, trained = load_env_config("medium"), load_env_config("easy")  # easy trains with it by default
    assert trained.block_repeats and not medium.block_repeats
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
    # the random policy and an untrained model are offered every command, on easy too, where
    # training plays with the rule by default
    assert evaluate("random", "easy", games=1)[0]["block_repeats"] is False

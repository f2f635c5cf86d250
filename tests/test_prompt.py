import copy

import pytest

from textrl.games.env import TextGame
from textrl.games.prompt import PromptBuilder, PromptTooLongError


def play_some(path, commands=("look", "inventory", "look")):
    env = TextGame(path, 8)
    env.reset()
    snapshots = [(env.observation, list(env.history))]
    for command in commands:
        env.step(command)
        snapshots.append((env.observation, list(env.history)))
    return env, snapshots


def test_chat_template_prompt_holds_objective_observation_and_generation_prompt(prompts, easy_games):
    env, snaps = play_some(easy_games[0])
    obs, history = snaps[0]
    text = prompts.tokenizer.decode(prompts.build(obs, history))
    assert prompts.chat and text.startswith("<|im_start|>system")
    assert obs.objective in text and obs.inventory in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "Commands:" not in text  # the blog post leaves them out by default


def test_prompts_are_append_only_so_the_kv_cache_can_be_reused(prompts, easy_games):
    env, snaps = play_some(easy_games[0])
    for (obs_a, hist_a), (obs_b, hist_b) in zip(snaps, snaps[1:]):
        a, b = prompts.build(obs_a, hist_a), prompts.build(obs_b, hist_b)
        command = hist_b[-1].command
        expected_prefix = a + prompts.encode_command(command) + [prompts.end_id]
        assert b[: len(expected_prefix)] == expected_prefix


def test_oldest_history_is_dropped_first_a_block_at_a_time(prompts, easy_games):
    env, snaps = play_some(easy_games[0], commands=["look", "inventory"] * 4)
    obs, history = snaps[-1]
    assert len(history) == 8
    full = prompts.build(obs, history)
    block = PromptBuilder.DROP_BLOCK
    without_oldest = prompts.build(obs, history[block:])
    small = PromptBuilder(prompts.tokenizer, max_prompt_tokens=len(full) - 1)
    assert small.build(obs, history) == without_oldest
    alone = prompts.build(obs, [])
    with pytest.raises(PromptTooLongError, match="max_prompt_tokens"):
        PromptBuilder(prompts.tokenizer, max_prompt_tokens=len(alone) - 1).build(obs, [])


def test_a_budget_cut_passes_over_the_kept_answer(prompts, easy_games):
    """env.keep_answers=[inventory]: the turn showing the inventory's answer outlives older turns."""
    env, snaps = play_some(easy_games[0], commands=["look", "inventory"] + ["look"] * 6)
    obs, history = snaps[-1]
    assert history[2].answer_to == "inventory" and len(history) == 8
    full = prompts.build(obs, history)
    small = PromptBuilder(prompts.tokenizer, max_prompt_tokens=len(full) - 1, keep_answers=["inventory"])
    # the block of 4 oldest turns, less the kept one, and the next turn in its place
    assert small.build(obs, history) == prompts.build(obs, [history[2]] + history[5:])


def test_over_budget_prompts_restart_once_per_block_not_every_turn(prompts, easy_games):
    env = TextGame(easy_games[0], max_steps=14, history_len=100)
    env.reset()
    budget = None
    built = []
    for i in range(14):
        if i == 5:  # about five turns fit
            budget = PromptBuilder(prompts.tokenizer, max_prompt_tokens=len(built[-1]))
        built.append((budget or prompts).build(env.observation, env.history))
        env.step(["look", "inventory"][i % 2])
    extends = [b[: len(a)] == a for a, b in zip(built, built[1:])]
    restarts = [i for i, ok in enumerate(extends) if not ok]
    assert restarts, "the budget never bound"
    assert all(b - a > 1 for a, b in zip(restarts, restarts[1:])), extends  # never two turns in a row


def test_listing_commands_is_an_option(prompts, easy_games):
    env, snaps = play_some(easy_games[0], ())
    obs, history = snaps[0]
    listed = PromptBuilder(prompts.tokenizer, list_commands=True)
    text = prompts.tokenizer.decode(listed.build(obs, history))
    assert "Commands: " + ", ".join(obs.admissible_commands) in text


def test_goal_last_repeats_the_objective_right_before_the_command_and_stays_append_only(prompts, easy_games):
    env, snaps = play_some(easy_games[0])
    builder = PromptBuilder(prompts.tokenizer, goal_last=True)
    obs, history = snaps[-1]
    text = prompts.tokenizer.decode(builder.build(obs, history))
    goal = "Goal: " + obs.objective
    assert text.count(goal) == len(history) + 2  # system message + every observation
    assert text.rstrip().removesuffix("<|im_start|>assistant").rstrip().endswith(goal + "<|im_end|>")
    assert goal not in prompts.tokenizer.decode(prompts.build(obs, history)).split("<|im_end|>", 1)[1]
    for (obs_a, hist_a), (obs_b, hist_b) in zip(snaps, snaps[1:]):
        a, b = builder.build(obs_a, hist_a), builder.build(obs_b, hist_b)
        assert b[: len(a)] == a


def test_plain_transcript_without_a_chat_template(prompts, easy_games):
    tokenizer = copy.deepcopy(prompts.tokenizer)
    tokenizer.chat_template = None
    plain = PromptBuilder(tokenizer)
    assert not plain.chat and plain.end_id == tokenizer.eos_token_id
    env, snaps = play_some(easy_games[0])
    (obs_a, hist_a), (obs_b, hist_b) = snaps[0], snaps[1]
    a, b = plain.build(obs_a, hist_a), plain.build(obs_b, hist_b)
    assert tokenizer.decode(a).endswith("\n>") and obs_a.objective in tokenizer.decode(a)
    assert b[: len(a)] == a and b[len(a):].count(plain.end_id) == 1
    assert tokenizer.decode(plain.encode_command("look")) == " look"


def test_a_turns_prompt_tokenizes_only_its_new_text_and_gives_the_same_ids(tiny, easy_games):
    """An episode's prompt grows by one turn at a time; each earlier piece is tokenized once, not
    again at every turn (the rollout builds every row's prompt at every turn): the text a turn sends
    to the tokenizer stays flat as the history grows, and the ids are those of a fresh builder."""
    tokenizer = tiny[1]
    sent = []

    class Counting:  # the real tokenizer, with the characters it is asked to encode counted
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def encode(self, text, **kw):
            sent.append(len(text))
            return tokenizer.encode(text, **kw)

    builder = PromptBuilder(Counting(), max_prompt_tokens=4096)
    env, snaps = play_some(easy_games[0], commands=["look", "inventory"] * 3 + ["look"])  # the 8 steps it allows
    per_turn = []
    for obs, history in snaps:
        sent.clear()
        ids = builder.build(obs, history)
        per_turn.append(sum(sent))
        assert ids == PromptBuilder(tokenizer, max_prompt_tokens=4096).build(obs, history)
    full = len(tokenizer.decode(builder.build(*snaps[-1])))
    assert max(per_turn[2:]) < full / 3  # the newest turn's text, not the whole transcript (8 turns)
    assert max(per_turn[1:]) <= per_turn[0]  # flat: no later turn sends more than the first (a repeated answer: none)

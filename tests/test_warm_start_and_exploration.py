"""Walkthrough warm start and the exploration mixture, on real games and the tiny model."""

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch

import textrl.cli.train as cli
import textrl.training.random_play as rp
import textrl.training.warm_start as ws
from textrl.games.pool import EVAL_SEED_BASE, GamePool, GameSpec
from textrl.games.prompt import PromptBuilder
from textrl.policy.distribution import fork_logprobs, mix_uniform
from textrl.policy.model import build_policy, transformer_blocks
from textrl.policy.trie import CommandTrie
from textrl.ppo.sequences import training_sequences
from textrl.rollout import Sampling, play_games
from tests.conftest import Snapshot, config, read_metrics


def test_exploration_mixture_keeps_every_child_above_its_floor_and_is_a_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=g) * 8  # confident rows
    allowed = torch.zeros(3, 12, dtype=torch.bool)
    for i, children in enumerate([[1, 4], [0, 2, 7, 9, 11], [5]]):
        allowed[i, children] = True
    eps = 0.2
    plain, mixed = fork_logprobs(logits, allowed), fork_logprobs(logits, allowed, 1.0, eps)
    n = allowed.sum(-1, keepdim=True)
    expected = ((1 - eps) * plain.exp() + eps / n).masked_fill(~allowed, 0.0)
    assert torch.allclose(mixed.exp(), expected, atol=1e-6)
    assert torch.allclose(mixed.exp().sum(-1), torch.ones(3), atol=1e-6)
    assert (mixed.exp()[allowed] >= (eps / n.expand_as(allowed))[allowed] - 1e-7).all()
    assert torch.isinf(mixed[~allowed]).all() and torch.equal(mix_uniform(plain, allowed, 0.0), plain)


def test_with_exploration_the_first_update_still_sees_ratio_one_and_rollouts_are_more_varied(tmp_path):
    result = cli.train(config(tmp_path, "iterations=1", "eval.every=1", "ppo.explore=0.5"))
    row = [r for r in read_metrics(tmp_path) if r.get("policy/first_logratio_max")][0]
    assert float(row["policy/first_logratio_max"]) < 1e-4  # the update recomputes the same mixture
    module = result["module"]
    games, seeds = [result["trainer"].datamodule.curriculum.train_games[0]] * 16, list(range(16))

    def first_commands(explore):  # T = 0.01: the model alone is (nearly) greedy
        episodes, _ = play_games(module.player, games, module.cfg.env, Sampling(0.01, seeds, explore))
        return {e.steps[0].action.command for e in episodes}

    assert len(first_commands(0.9)) > len(first_commands(0.0))


def test_walkthroughs_replay_as_the_turns_a_rollout_records(tiny):
    policy, tokenizer = tiny
    cfg = config("unused", "warm_start.games=6")
    prompts = PromptBuilder(tokenizer, cfg.env.max_prompt_tokens)
    games = GamePool("easy").games("train", 6)
    episodes, skipped = ws.walkthrough_episodes(games, prompts, cfg)
    assert len(episodes) + len(skipped) == 6 and episodes
    for episode in episodes:
        assert episode.won and episode.steps[-1].terminated
        for step in episode.steps:
            obs = step.observation
            trie = CommandTrie(obs.admissible_commands, prompts.encode_command, prompts.end_id)
            assert step.action.command in obs.admissible_commands
            assert step.action.command_ids == trie.commands[step.action.command]
            forks = trie.decisions(step.action.command)
            assert [d.index for d in step.action.decisions] == forks
            node = trie.root
            for k, token in enumerate(step.action.command_ids):
                if k in forks:
                    assert step.action.decisions[forks.index(k)].allowed == sorted(node.children)
                node = node.children[token]


def test_the_command_probability_of_the_first_sequences_keeps_each_decision_on_its_turn(tiny):
    """The warm start measures the walkthrough commands' probability on its first PROBE_SEQUENCES
    sequences with the whole run's list of decision turns: each decision must still be counted on
    its own turn (the product over a command's decisions), as computed directly here."""
    policy, tokenizer = tiny
    cfg = config("unused", "warm_start.games=4")
    prompts = PromptBuilder(tokenizer, cfg.env.max_prompt_tokens)
    episodes, _ = ws.walkthrough_episodes(GamePool("easy").games("train", 4), prompts, cfg)
    sequences = training_sequences(episodes).sequences
    steps = [step for episode in episodes for step in episode.steps]
    turns = [t for t, step in enumerate(steps) for _ in step.action.decisions]
    first = sequences[:2]
    assert len(sequences) > 2 and 0 < sum(len(s.decisions) for s in first) < len(turns)
    fabric = ws.make_fabric(cfg)
    got = ws.command_probability(policy, first, tokenizer.pad_token_id, fabric, turns, 1)
    with torch.no_grad():
        logps = [float(lp) for s in first for lp in ws._decision_logprobs(policy, [s], tokenizer.pad_token_id)]
    per_turn = {}
    for turn, lp in zip(turns, logps):
        per_turn[turn] = per_turn.get(turn, 0.0) + lp
    direct = sum(math.exp(v) for v in per_turn.values()) / len(per_turn)
    assert got == pytest.approx(direct, rel=1e-5)
    assert len(per_turn) < len(set(turns))  # the first sequences' turns only


def test_warm_start_raises_the_walkthrough_commands_probability_and_reads_only_training_games(tmp_path, monkeypatch,
                                                                                            caplog):
    opened = []

    real_open = ws.open_game

    def recording(game, env):  # a spy: the real games are still played
        opened.append(str(game))
        return real_open(game, env)

    monkeypatch.setattr(ws, "open_game", recording)
    cfg = config(tmp_path, "warm_start.steps=12", "warm_start.games=8", "warm_start.batch=4", "warm_start.lr=3e-3")
    torch.manual_seed(0)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    with caplog.at_level(logging.INFO, logger=ws.__name__):
        figures = ws.warm_start(policy, tokenizer, cfg)
    assert figures["warm_start/walkthroughs"] + figures["warm_start/skipped"] == 8
    # a progress line while it runs: every max(1, steps // 8) steps, so here every one of the 12
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("warm start: step ")]
    assert len(progress) == 12 and progress[-1].startswith("warm start: step 12 of 12, cross-entropy ")
    assert figures["warm_start/command_prob_end"] > figures["warm_start/command_prob_start"] + 0.05
    assert figures["warm_start/loss_last"] < figures["warm_start/loss_first"]
    eval_games = {str(g) for g in GamePool("easy").games("eval", 32)}
    assert len(opened) == 8 and not set(opened) & eval_games
    assert all(int(Path(g).parent.name) < EVAL_SEED_BASE for g in opened)


def test_a_warm_start_alone_writes_a_checkpoint_that_a_ppo_run_starts_from(tmp_path):
    alone = cli.train(config(tmp_path / "ws", "iterations=0", "warm_start.steps=3", "warm_start.games=4"))
    assert alone["last"].endswith("warm_start.ckpt")
    figures = json.loads((tmp_path / "ws" / "warm_start.json").read_text())
    rows = read_metrics(tmp_path / "ws")
    assert any(r.get("warm_start/command_prob_end") for r in rows)
    assert any(r.get("eval/win_rate") for r in rows)  # the warm-started policy, evaluated
    assert math.isfinite(figures["warm_start/loss_last"])

    snapshot = Snapshot()
    ppo = cli.train(config(tmp_path / "ppo", "iterations=1", "eval.before_training=false",
                           f"model.init_from={alone['last']}"), callbacks=[snapshot])
    warmed = alone["module"].policy.state_dict()
    assert all(torch.equal(snapshot.weights[k], warmed[k]) for k in warmed)  # PPO starts from the warm start
    rows = read_metrics(tmp_path / "ppo")
    assert [float(r["iteration"]) for r in rows if r.get("eval/win_rate")] == [1.0]  # no evaluation before training
    assert ppo["module"].iterations_done == 1


def test_warm_start_iterations_zero_needs_steps(tmp_path):
    with pytest.raises(cli.ConfigError, match="iterations=0 is not allowed"):
        config(tmp_path, "iterations=0")


def test_no_evaluation_game_is_played_in_warm_start_or_training(tmp_path, monkeypatch):
    """Spies (the real games are played): every game the warm start opens and every game a training
    rollout plays is a training game; the evaluation games are only played greedily."""
    import textrl.training.module as module

    opened, sampled, greedy = [], [], []
    real_open, real_play = ws.open_game, module.play_games

    def open_game(game, env):  # the warm start's games
        opened.append(str(game))
        return real_open(game, env)

    def play_games(player, games, env, sampling=None):
        (greedy if sampling is None else sampled).extend(str(g) for g in games)
        return real_play(player, games, env, sampling)

    monkeypatch.setattr(ws, "open_game", open_game)
    monkeypatch.setattr(module, "play_games", play_games)
    result = cli.train(config(tmp_path, "iterations=2", "eval.every=1", "warm_start.steps=2", "warm_start.games=4"))
    eval_games = {str(g) for g in result["trainer"].datamodule.eval_games}
    assert opened and sampled and eval_games <= set(greedy)
    assert not (set(opened) | set(sampled)) & eval_games


@pytest.mark.parametrize("memory", ["none", "bf16"])
@pytest.mark.parametrize("minibatch", [1, 4], ids=["alone", "packed"])
def test_the_cloning_runs_the_frozen_blocks_once_per_sequence_and_learns_the_same_weights(tmp_path, monkeypatch,
                                                                                          memory, minibatch):
    """Under ``ppo.cache_frozen`` the cloning records the frozen blocks' output at each sequence's first
    forward and replays it in every later pass: the lowest block runs once per sequence (and for the
    probability probes), not at every step, and the cloned weights are bit for bit those of running
    every block at every step. Packed (``ppo.minibatch_size=4``: a step's 4 sequences in one forward),
    the first step records all four in one forward and each later step replays them in its own
    shuffled order, each sequence's recording cut out of the pack it was recorded in."""
    weights, runs, made = {}, {}, []
    real = ws.training_sequences
    monkeypatch.setattr(ws, "training_sequences", lambda episodes: made.append(real(episodes)) or made[-1])
    for cache in (True, False):
        cfg = config(tmp_path / str(cache), f"memory={memory}", "model.trainable_layers=1", "warm_start.steps=6",
                     "warm_start.games=4", "warm_start.batch=4", f"ppo.minibatch_size={minibatch}",
                     f"ppo.cache_frozen={str(cache).lower()}")
        policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
        calls = []
        # its MLP: a replayed block returns the recording without running its modules (its own hooks still fire)
        hook = transformer_blocks(policy.lm)[0].mlp.register_forward_hook(lambda *args: calls.append(1))
        try:
            ws.warm_start(policy, tokenizer, cfg)
        finally:
            hook.remove()
        weights[cache] = {n: p.detach().clone() for n, p in policy.lm.named_parameters() if p.requires_grad}
        runs[cache] = len(calls)
    sequences = len(made[-1].sequences)
    assert sequences == 4  # every step takes all four, in a new order each pass
    forwards = 4 // minibatch  # per step: one per sequence, or one packed forward of the four
    probes = 2 * math.ceil(min(sequences, ws.PROBE_SEQUENCES) / minibatch)  # before and after, in full
    assert runs[False] == 6 * forwards + probes and runs[True] == forwards + probes < runs[False]
    assert weights[True].keys() == weights[False].keys()
    assert all(torch.equal(weights[True][n], weights[False][n]) for n in weights[False])


# ---- warm_start.source=random_play: wins found by random play, loops erased ----------------------------

def test_loop_erasure_cuts_each_return_to_a_state_back_to_its_first_visit():
    a, b, c, d, e = (("room " + r, "carrying nothing") for r in "ABCDE")
    # A -> B -> C -> back at B: [A, B] -> D -> back at A: [A] -> E
    assert rp.loop_erased(["a1", "b1", "c1", "b2", "d1", "a2", "e1"], [a, b, c, b, d, a, e]) == ["a2", "e1"]
    assert rp.loop_erased(["x", "y", "z"], [a, b, c]) == ["x", "y", "z"]  # no return: nothing cut
    # the same room with another inventory is another state
    assert rp.loop_erased(["take key", "go east"], [a, (a[0], "a key")]) == ["take key", "go east"]


def test_random_play_clones_a_win_it_found_itself_without_loops_the_same_way_every_time(tiny, monkeypatch):
    """On real medium games: each kept episode won, replayed as the turns a rollout records, its
    commands a loop-erased random win (no state shown twice), no longer than the win as played;
    exploring again with the same seed finds the same win, another seed another one somewhere, and
    only training games are opened."""
    _, tokenizer = tiny
    cfg = config("unused", "env=medium")
    prompts = PromptBuilder.for_env(tokenizer, cfg.env)
    opened = []
    real_open = rp.open_game
    monkeypatch.setattr(rp, "open_game", lambda game, env: opened.append(str(game)) or real_open(game, env))
    games = GamePool(GameSpec.from_env(cfg.env)).games("train", 4)
    found = [rp.explore(game, cfg.env, prompts, seed=1, tries=8) for game in games]
    kept = [f for f in found if f.episode is not None]
    assert kept, "random play won none of 4 medium games in 8 episodes each"
    for f in kept:
        episode = f.episode
        assert episode.won and episode.steps[-1].terminated and 1 <= f.episodes <= 8
        assert episode.length <= f.played
        states = [step.observation.state for step in episode.steps]
        assert len(set(states)) == len(states)  # loop-free: no state shown twice
        for step in episode.steps:
            trie = prompts.trie(step.observation)
            assert step.action.command_ids == trie.commands[step.action.command]
    assert any(f.played > f.episode.length for f in kept)  # a random win with loops, cut
    again = [rp.explore(game, cfg.env, prompts, seed=1, tries=8) for game in games]
    commands = [[s.action.command for s in f.episode.steps] if f.episode else None for f in found]
    assert [[s.action.command for s in f.episode.steps] if f.episode else None for f in again] == commands
    other = [rp.explore(game, cfg.env, prompts, seed=2, tries=8) for game in games]
    assert [f.played for f in other] != [f.played for f in found]
    assert len(opened) == 3 * 4 and all(int(Path(g).parent.name) < EVAL_SEED_BASE for g in opened)


def test_a_random_play_warm_start_clones_the_wins_it_found_and_never_a_walkthrough(tmp_path, monkeypatch):
    """No walkthrough is replayed (spies on both modules' ``replay_commands``; the real games are
    played): the only replays are of random play's wins, one per game it won, and the figures count them."""
    replayed = []
    real = rp.replay_commands
    monkeypatch.setattr(rp, "replay_commands", lambda game, prompts, commands=None: replayed.append(commands) or
                        real(game, prompts, commands))
    monkeypatch.setattr(ws, "replay_commands", lambda *args: pytest.fail("a walkthrough was replayed"))
    cfg = config(tmp_path, "env=medium", "warm_start.source=random_play", "warm_start.steps=2",
                 "warm_start.games=6", "warm_start.batch=2")
    torch.manual_seed(0)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    figures = ws.warm_start(policy, tokenizer, cfg)
    assert figures["warm_start/random_wins"] <= len(replayed) <= 6 and None not in replayed
    assert figures["warm_start/random_wins"] + figures["warm_start/skipped"] == 6
    assert figures["warm_start/random_wins"] >= 1 and "warm_start/walkthroughs" not in figures
    assert 1 <= figures["warm_start/cloned_turns"] <= figures["warm_start/random_win_turns"]
    assert math.isfinite(figures["warm_start/loss_last"])


def test_random_play_that_wins_nothing_stops_the_run_with_the_option_to_change(tmp_path):
    """A medium quest takes more than one step: with a one-step limit random play cannot win."""
    cfg = config(tmp_path, "env=medium", "env.max_steps=1", "warm_start.source=random_play", "warm_start.steps=2",
                 "warm_start.games=2", "warm_start.tries=2")
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    with pytest.raises(cli.ConfigError, match="warm_start.tries=2"):
        ws.warm_start(policy, tokenizer, cfg)


@pytest.mark.parametrize("override, named", [("warm_start.source=demos", "warm_start.source='demos'"),
                                             ("warm_start.tries=0", "warm_start.tries=0")])
def test_a_bad_random_play_option_is_refused_by_name(tmp_path, override, named):
    with pytest.raises(cli.ConfigError, match=re.escape(named)):
        config(tmp_path, override)


def test_a_game_that_faults_during_random_play_is_skipped_and_the_warm_start_goes_on(tmp_path, monkeypatch):
    """An engine fault (injected into the first game's third engine step; the games are real) costs
    that game's wins, not the run: the other games are explored and cloned, and the fault is counted."""
    from tests.faulty_games import inject

    real_open, opened = rp.open_game, []

    def open_game(game, env):
        opened.append(game)
        played = real_open(game, env)
        if game == opened[0]:
            inject(played, 3, "engine_raises")
        return played

    monkeypatch.setattr(rp, "open_game", open_game)
    cfg = config(tmp_path, "env=medium", "warm_start.source=random_play", "warm_start.steps=1",
                 "warm_start.games=4", "warm_start.batch=2")
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    figures = ws.warm_start(policy, tokenizer, cfg)
    assert figures["warm_start/random_play_faults"] == 1 and len(set(opened)) == 4
    assert 1 <= figures["warm_start/random_wins"] <= 3 and figures["warm_start/skipped"] >= 1

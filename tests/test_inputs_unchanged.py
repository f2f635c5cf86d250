"""Functions leave their inputs as they were: ``training_sequences`` reads the episodes (their
recordings of the frozen blocks' outputs included), and ``play_games`` plays with the decoders as
they were made, for training rollouts and evaluations alike."""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from textrl.config import load_env_config, load_model_config
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.speed.frozen_prefix import FrozenPrefix
from textrl.policy.model import build_policy
from textrl.ppo.sequences import release_prefix_outputs, training_sequences
from textrl.rollout import Player, Sampling, play_games


def _decoder_settings(player: Player) -> list[tuple]:
    return [(d.capture, d.drop_cut_turns, d.batched) for d in player.decoders]


def test_training_sequences_and_play_games_leave_their_inputs_as_they_were(easy_games):
    torch.manual_seed(0)
    policy, tokenizer = build_policy(load_model_config("tiny", trainable_layers=1))
    frozen = FrozenPrefix.of(policy.lm)
    env = replace(load_env_config("easy"), history_len=2, max_steps=6, drop_turns_from_cache=True)
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy, capture=frozen, drop_cut_turns=True)
                                        for _ in range(2)])
    made = _decoder_settings(player)

    episodes, _ = play_games(player, easy_games[:4], env, Sampling(1.0, [0, 1, 2, 3]))  # a training rollout
    assert _decoder_settings(player) == made
    greedy, _ = play_games(player, easy_games[:2], env)  # an evaluation: records nothing, changes nothing
    assert _decoder_settings(player) == made
    assert all(s.action.prefix_output is None for e in greedy for s in e.steps)

    recordings = [[s.action.prefix_output for s in e.steps] for e in episodes]
    assert any(r is not None for steps in recordings for r in steps)
    before = copy.deepcopy(episodes)
    rollout = training_sequences(episodes)
    assert episodes == before  # every field that compares (the recordings do not: compare=False)
    assert all(r is s.action.prefix_output for steps, e in zip(recordings, episodes) for r, s in zip(steps, e.steps))
    assert any(p is not None for p in rollout.prefix_outputs)
    # a second read gives the same sequences; the update releases the recordings by name, after its read
    again = training_sequences(episodes)
    assert again.sequences == rollout.sequences
    assert all(torch.equal(a, b) for a, b in zip(again.prefix_outputs, rollout.prefix_outputs) if a is not None)
    release_prefix_outputs(episodes)
    assert all(s.action.prefix_output is None for e in episodes for s in e.steps)

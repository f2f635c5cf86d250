"""Rollout episodes -> training sequences with advantages.

Consecutive turns of an episode are merged into one sequence whenever the next prompt extends
the previous prompt + command (the prompt builder makes prompts append-only until history is
truncated), so one forward over the sequence gives the new log-probs of the decisions of all those
turns at once. Causal attention makes this exactly the computation of one forward per turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from textrl.ppo.advantages import gae, whiten
from textrl.rollout import Episode


@dataclass
class Sequence:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # hidden state index that predicts each decision token
    allowed: list[list[int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    old_logprobs: list[float] = field(default_factory=list)
    old_values: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    returns: list[float] = field(default_factory=list)


def decision_rewards(episode: Episode) -> list[float]:
    """Per-decision rewards under the rule in ``textrl.ppo.advantages``."""
    rewards: list[float] = []
    for step in episode.steps:
        if step.action.decisions:
            rewards += [0.0] * len(step.action.decisions)
            rewards[-1] += step.reward
        elif rewards:
            rewards[-1] += step.reward
    return rewards


def episode_sequences(episode: Episode) -> list[Sequence]:
    sequences: list[Sequence] = []
    current: Sequence | None = None
    for step in episode.steps:
        prefix = step.prompt_ids
        if current is None or current.input_ids != prefix[: len(current.input_ids)]:
            current = Sequence()
            sequences.append(current)
        current.input_ids += prefix[len(current.input_ids):] + step.action.command_ids
        base = len(prefix)
        for d in step.action.decisions:
            current.positions.append(base + d.index - 1)
            current.allowed.append(d.allowed)
            current.tokens.append(d.token)
            current.old_logprobs.append(d.logprob)
            current.old_values.append(d.value)
            current.temperatures.append(step.action.temperature)
    return [s for s in sequences if s.tokens]


def build_sequences(episodes: list[Episode], gamma: float, lam: float, normalize: bool = True) -> list[Sequence]:
    """Sequences with GAE advantages and returns, advantages whitened over the whole rollout."""
    sequences, adv_all, ret_all = [], [], []
    for episode in episodes:
        rewards = decision_rewards(episode)
        if not rewards:
            continue
        seqs = episode_sequences(episode)
        values = torch.tensor([v for s in seqs for v in s.old_values], dtype=torch.float64)
        dones = torch.zeros(len(rewards))
        dones[-1] = 1
        adv, ret = gae(torch.tensor(rewards, dtype=torch.float64), values, dones, gamma, lam)
        adv_all.append(adv)
        ret_all.append(ret)
        sequences += seqs
    if not sequences:
        return []
    adv = torch.cat(adv_all)
    if normalize:
        adv = whiten(adv)
    ret = torch.cat(ret_all)
    k = 0
    for s in sequences:
        n = len(s.tokens)
        s.advantages = adv[k: k + n].tolist()
        s.returns = ret[k: k + n].tolist()
        k += n
    return sequences


def minibatches(sequences: list[Sequence], size: int, epochs: int, rng: random.Random):
    """``epochs`` shuffled passes over the sequences, ``size`` sequences at a time."""
    for _ in range(epochs):
        order = list(range(len(sequences)))
        rng.shuffle(order)
        for i in range(0, len(order), size):
            yield [sequences[j] for j in order[i: i + size]]

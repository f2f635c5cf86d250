"""Rollout episodes -> training sequences with advantages, and the optimizer steps over them.

Consecutive turns of an episode are merged into one sequence whenever the next prompt extends
the previous prompt + command (the prompt builder makes prompts append-only until history is
truncated), so one forward over the sequence gives the new log-probs of the decisions of all those
turns at once. Causal attention makes this exactly the computation of one forward per turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from textrl.policy.decoding import fork_index
from textrl.policy.frozen_prefix import FrozenPrefix
from textrl.ppo.advantages import gae, grpo, rloo, whiten
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
    ref_logprobs: list[list[float]] = field(default_factory=list)  # KL anchor: the reference's, per allowed token
    # the last frozen block's output over input_ids, recorded by the sequence's first forward of the
    # iteration and replayed by the later ones (textrl.policy.frozen_prefix); None until then
    frozen_output: torch.Tensor | None = field(default=None, compare=False, repr=False)


def episode_sequences(episode: Episode) -> list[Sequence]:
    """The episode's turns merged into sequences (module docstring), each ending at its last
    decision's position: the tokens after it feed nothing the update reads. When the rollout kept the
    frozen blocks' outputs (``Action.frozen``), the sequence takes them over as its ``frozen_output``,
    so that not even its first forward of the iteration runs the frozen blocks."""
    sequences: list[Sequence] = []
    captured: list[tuple[list[int], list[torch.Tensor]] | None] = []
    current: Sequence | None = None
    for step in episode.steps:
        prefix = step.prompt_ids
        if current is None or current.input_ids != prefix[: len(current.input_ids)]:
            current = Sequence()
            sequences.append(current)
            captured.append(None)
        current.input_ids += prefix[len(current.input_ids):] + step.action.command_ids
        base = len(prefix)
        for d in step.action.decisions:
            current.positions.append(base + d.index - 1)
            current.allowed.append(d.allowed)
            current.tokens.append(d.token)
            current.old_logprobs.append(d.logprob)
            current.old_values.append(d.value)
            current.temperatures.append(step.action.temperature)
        if step.action.frozen is not None:  # the row's cache so far: the sequence's latest covers it all
            captured[-1], step.action.frozen = step.action.frozen, None
    out = []
    for s, capture in zip(sequences, captured):
        if not s.tokens:
            continue
        del s.input_ids[max(s.positions) + 1:]
        if capture is not None:
            ids, pieces = capture
            # the cache holds exactly these tokens unless the decoder restarted the row where the
            # sequence did not break (then the frozen blocks run in the sequence's first forward)
            if ids[: len(s.input_ids)] == s.input_ids:
                s.frozen_output = torch.cat(pieces)[: len(s.input_ids)]
        out.append(s)
    return out


class Decisions(NamedTuple):
    """A forward's outputs at the decisions of a batch of sequences, flat in order. Each fork's
    allowed tokens are one row, padded to the widest fork by repeating its first token (``valid``
    marks the real entries): the logits of the rest of the vocabulary are never computed, as in the
    rollout (``PolicyValueModel.logits_of``)."""

    logits: torch.Tensor  # [decisions, width] float32
    valid: torch.Tensor  # [decisions, width] bool
    chosen: torch.Tensor  # [decisions] long: the entry (column) of the token taken
    values: torch.Tensor  # [decisions]
    fed: int  # real tokens fed (padding left out)


def decision_forward(policy, batch: list[Sequence], pad_id: int, frozen: FrozenPrefix | None = None) -> Decisions:
    """One right-padded forward over the sequences: the logits of each decision's allowed tokens
    and its value (``Decisions``). Shared by the PPO update and the warm start.

    With ``frozen``, a batch whose sequences all hold a recorded frozen-block output skips the frozen
    blocks; any other batch runs in full and records it for the sequences' later forwards."""
    device = next(policy.parameters()).device
    width = max(len(s.input_ids) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(batch):  # right padding: positions are plain 0..n-1, as in the rollout
        ids[r, : len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[r, : len(s.input_ids)] = 1
    positions = torch.arange(width)[None].expand_as(ids)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    if frozen is None:
        hidden, _ = policy.hidden(ids, mask, positions)
    elif all(s.frozen_output is not None for s in batch):
        # zeros at the padding: causal attention keeps them out of every real position
        recorded = torch.nn.utils.rnn.pad_sequence([s.frozen_output for s in batch], batch_first=True)
        with frozen.replay(recorded):
            hidden, _ = policy.hidden(ids, mask, positions)
    else:
        with frozen.record() as recorded:
            hidden, _ = policy.hidden(ids, mask, positions)
        output = frozen.recorded_output(recorded)
        for r, s in enumerate(batch):
            s.frozen_output = output[r, : len(s.input_ids)].detach()
    rows = torch.tensor([r for r, s in enumerate(batch) for _ in s.positions], device=device)
    cols = torch.tensor([c for s in batch for c in s.positions], device=device)
    h = hidden[rows, cols]
    allowed = [a for s in batch for a in s.allowed]
    index, valid = fork_index(allowed, device)
    chosen = torch.tensor([a.index(t) for a, t in zip(allowed, (t for s in batch for t in s.tokens))], device=device)
    return Decisions(policy.logits_of(h, index), valid, chosen, policy.value(h), int(mask.sum()))


def decision_advantages(episode: Episode, values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """(advantages, returns) of an episode's decisions, in order, under the rule in
    ``textrl.ppo.advantages``; ``values`` are the decisions' value estimates in the same order."""
    rewards, discounts, first, counts = [], [], [], []
    k = 0
    for step in episode.steps:
        n = len(step.action.decisions)
        if n:
            rewards.append(step.reward)
            discounts.append(gamma)
            first.append(values[k])
            counts.append(n)
            k += n
        elif rewards:  # a turn without a decision: part of the previous turn's transition
            rewards[-1] += discounts[-1] * step.reward
            discounts[-1] *= gamma
    if k != len(values):
        raise ValueError(f"{len(values)} values for the {k} decisions of {episode.game}")
    if not rewards:
        return [], []
    if episode.truncated and episode.bootstrap_value is None:
        raise ValueError(f"the episode of {episode.game} was truncated but has no bootstrap value: "
                         f"play training rollouts with play(..., bootstrap=True)")
    last = episode.bootstrap_value if episode.truncated else 0.0
    f64 = torch.float64
    _, turn_returns = gae(torch.tensor(rewards, dtype=f64), torch.tensor(first, dtype=f64),
                          torch.tensor(discounts, dtype=f64), lam, last)
    returns = torch.repeat_interleave(turn_returns, torch.tensor(counts))
    return (returns - torch.tensor(values, dtype=f64)).tolist(), returns.tolist()


def add_advantages(episodes: list[Episode], sequences: list[list[Sequence]], gamma: float, lam: float,
                   normalize: bool = True, estimator: str = "gae") -> None:
    """Fill ``advantages`` and ``returns`` of every sequence (``sequences[i]``: episode i's, from
    ``episode_sequences``); advantages are whitened over the rollout when ``normalize``.

    ``gae``: per decision, from the sequences' ``old_values`` (``decision_advantages``). ``grpo`` /
    ``rloo``: one advantage per episode, from its return against the other episodes of its game,
    given to each of its decisions; ``returns`` then hold the episode's return (no value target).
    """
    flat, adv_all, ret_all = [], [], []
    if estimator == "gae":
        for episode, seqs in zip(episodes, sequences):
            adv, ret = decision_advantages(episode, [v for s in seqs for v in s.old_values], gamma, lam)
            adv_all += adv
            ret_all += ret
            flat += seqs
    else:
        returns = torch.tensor([e.total_return for e in episodes], dtype=torch.float64)
        group = {"grpo": grpo, "rloo": rloo}[estimator](returns, [e.game for e in episodes])
        for episode, seqs, a, r in zip(episodes, sequences, group.tolist(), returns.tolist()):
            n = sum(len(s.tokens) for s in seqs)
            adv_all += [a] * n
            ret_all += [r] * n
            flat += seqs
    adv = torch.tensor(adv_all, dtype=torch.float64)
    if normalize and adv.numel():
        adv = whiten(adv)
    k = 0
    for s in flat:
        n = len(s.tokens)
        s.advantages = adv[k: k + n].tolist()
        s.returns = ret_all[k: k + n]
        k += n


def optimizer_steps(sequences: list[Sequence], minibatch_size: int, grad_accum: int, epochs: int,
                    rng: random.Random) -> list[list[list[Sequence]]]:
    """``epochs`` shuffled passes over the sequences, as optimizer steps of up to ``grad_accum``
    minibatches of ``minibatch_size`` sequences (each pass's last step may be smaller)."""
    steps = []
    for _ in range(epochs):
        order = list(range(len(sequences)))
        rng.shuffle(order)
        batches = [[sequences[j] for j in order[i: i + minibatch_size]] for i in range(0, len(order), minibatch_size)]
        steps += [batches[i: i + grad_accum] for i in range(0, len(batches), grad_accum)]
    return steps

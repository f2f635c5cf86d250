"""Rollout episodes -> training sequences, the one forward over a batch of them, and the
optimizer steps over them.

The turns an episode's row played in one stream of its decoder's cache -- every token fed since
the row last started at position 0, the history's cuts included (``textrl.policy.speed.stream``) -- are
one sequence, so one forward over it gives the new log-probs of the decisions of all those turns at
once. Causal attention, with each cut's tokens hidden from the tokens fed after it
(``stream_attention``), makes this exactly the computation the rollout did turn by turn.

A sequence is built once and never written to. What belongs to its decisions (the rollout's
log-probs and values, then old log-probs, advantages, returns, reference log-probs) lives in flat
tensors over all of the iteration's decisions, in rollout order; ``TrainingSequence.decisions``
is where a sequence's decisions sit in them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from textrl.policy.device import ints_to_device
from textrl.policy.distribution import Forks, fork_parts
from textrl.policy.speed import Drop, FrozenPrefix, StreamLayout
from textrl.policy.model import SDPA, PolicyValueModel
from textrl.rollout import Episode


# a packed forward's tokens at most: rows of a few hundred tokens leave the matrix units idle, rows of
# several thousand spill the elementwise work out of the caches; a sequence this long runs alone, as
# before packing (bench/packed_update.py, bench/op_profile.py)
PACK_TOKENS = 1024


@dataclass(frozen=True)
class TrainingSequence:
    index: int  # its place in the iteration's sequences (PrefixOutputs keeps its recording there)
    first: int  # its first decision's place in the iteration's flat decision order
    input_ids: list[int]
    positions: list[int]  # the hidden state index that predicts each decision token
    allowed: list[list[int]]  # each decision's fork: its children, sorted
    tokens: list[int]  # each decision's token taken
    drops: tuple[Drop, ...] = ()  # cut turns its later tokens do not see (``textrl.policy.speed.stream``)

    @property
    def decisions(self) -> range:
        return range(self.first, self.first + len(self.tokens))


@dataclass
class RolloutDecisions:
    """An iteration's training sequences and what the rollout recorded at each decision, flat in
    rollout order (episodes, turns, forks)."""

    sequences: list[TrainingSequence]
    logprobs: torch.Tensor  # [decisions] float32: log-prob of the token taken, as sampled
    values: torch.Tensor  # [decisions] float32: the value head's estimate at the fork
    temperatures: torch.Tensor  # [decisions] float32: the temperature it was sampled at
    # per sequence, the last frozen block's output over its input_ids as the rollout recorded it
    # (textrl.policy.speed.frozen_prefix), or None
    prefix_outputs: list[torch.Tensor | None]

    @property
    def count(self) -> int:
        return self.logprobs.numel()


def training_sequences(episodes: list[Episode]) -> RolloutDecisions:
    """The episodes' turns merged into sequences (module docstring), each ending at its last
    decision's position: the tokens after it feed nothing the update reads. Each action's
    ``place`` says where the decoder put it in its row's stream; an action without one (not
    decoded: ``forced_action``) joins the sequence its prompt extends. When the rollout kept the
    frozen blocks' outputs (``Action.prefix_output``), the sequence's are taken from them (the
    episodes are left as they are: ``release_prefix_outputs`` lets the iteration hold one copy)."""
    sequences: list[TrainingSequence] = []
    prefix_outputs: list[torch.Tensor | None] = []
    logprobs, values, temperatures = [], [], []
    for episode in episodes:
        current: _Merging | None = None
        merged: list[_Merging] = []
        for step in episode.steps:
            prompt, place = step.prompt_ids, step.action.place
            if current is None or (current.ids != prompt[: len(current.ids)] if place is None else place.new):
                current = _Merging(first=len(logprobs))
                merged.append(current)
            if place is None:
                offset = len(prompt)
                current.ids += prompt[len(current.ids):]
            else:  # the stream as fed: up to this prompt (the last command's tokens the row never fed are
                # not in it: usually the prompt's new tokens start with them), then the prompt's new tokens
                offset = place.offset
                if len(current.ids) < place.start:
                    raise ValueError(f"an action's stream starts after its sequence ends ({place.start} > "
                                     f"{len(current.ids)}): its episode's steps are out of order or from other decoders")
                current.ids = current.ids[: place.start] + prompt[len(prompt) - (offset - place.start):]
                current.drops = place.drops
            current.ids += step.action.command_ids
            for d in step.action.decisions:
                current.positions.append(offset + d.index - 1)
                current.allowed.append(d.allowed)
                current.tokens.append(d.token)
                logprobs.append(d.logprob)
                values.append(d.value)
                temperatures.append(step.action.temperature)
            if step.action.prefix_output is not None:  # the row's cache so far: the latest covers it all
                current.captured = step.action.prefix_output
        for m in merged:
            if m.tokens:
                ids = m.ids[: max(m.positions) + 1]
                drops = tuple(d for d in m.drops if d.at < len(ids))
                sequences.append(TrainingSequence(len(sequences), m.first, ids, m.positions, m.allowed, m.tokens,
                                                  drops))
                prefix_outputs.append(_recorded_prefix(m.captured, ids))
    f32 = torch.float32
    return RolloutDecisions(sequences, torch.tensor(logprobs, dtype=f32), torch.tensor(values, dtype=f32),
                            torch.tensor(temperatures, dtype=f32), prefix_outputs)


@dataclass
class _Merging:
    """A sequence while its turns are merged."""

    first: int
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    allowed: list[list[int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    drops: tuple[Drop, ...] = ()
    captured: tuple[list[int], list[torch.Tensor]] | None = None


def release_prefix_outputs(episodes: list[Episode]) -> None:
    """Drops the rollout's recordings of the frozen blocks' outputs from the episodes' actions
    (``Action.prefix_output``), once ``training_sequences`` has taken the sequences' own from them:
    the iteration then holds one copy, not the pieces beside it."""
    for episode in episodes:
        for step in episode.steps:
            step.action.prefix_output = None


def _recorded_prefix(captured: tuple[list[int], list[torch.Tensor]] | None, ids: list[int]) -> torch.Tensor | None:
    """The rollout's recording over exactly ``ids``; None when there is none, or when it covers
    other tokens (a sequence merged from actions without a stream place; the sequence's first
    forward records it)."""
    if captured is None:
        return None
    fed, pieces = captured
    return torch.cat(pieces)[: len(ids)] if fed[: len(ids)] == ids else None


@dataclass
class PrefixOutputs:
    """The frozen blocks' output over each sequence, kept for the iteration: every forward over a
    sequence that has one replays it instead of running the frozen blocks; a forward over one that
    has none records it here (``decision_forward``)."""

    frozen: FrozenPrefix
    outputs: list[torch.Tensor | None]


class ForkOutputs(NamedTuple):
    """A forward's outputs at the decisions of a batch of sequences, flat in order. Each fork's
    allowed tokens are one row, padded to the widest fork (``Forks``; ``valid`` marks the
    real entries): the logits of the rest of the vocabulary are never computed, as in the
    rollout (``PolicyValueModel.logits_of``)."""

    logits: torch.Tensor  # [decisions, width] float32
    valid: torch.Tensor  # [decisions, width] bool
    chosen: torch.Tensor  # [decisions] long: the entry (column) of the token taken
    values: torch.Tensor  # [decisions]
    fed: int  # real tokens fed (padding left out)
    decisions: torch.Tensor  # [decisions] long, on the device: where they sit in the iteration's flat tensors


def decision_forward(policy: PolicyValueModel, batch: list[TrainingSequence], pad_id: int,
                     prefix: PrefixOutputs | None = None) -> ForkOutputs:
    """One forward over the sequences: the logits of each decision's allowed tokens and its value.
    Shared by the PPO update and the warm start.

    Everything it needs from the host (token ids, lengths, where each decision reads the hidden
    states, the forks' children, the tokens taken, the decisions' places) goes to the device in one
    copy (``ints_to_device``).

    Under textrl's attention (``SDPA``) the sequences are packed: back to back in rows of up to
    ``PACK_TOKENS`` tokens (a longer sequence alone), one forward each, every sequence at its own
    positions and every token attending to exactly the keys it attended to alone (its own
    sequence's, less its cut turns: ``textrl.policy.speed.stream``, with each sequence's start a cut
    that hides the ones before it). The linear layers then multiply a row's real tokens in one
    product, and no padding; attention stays one call per block of each sequence. Any other attention
    runs the sequences as one right-padded batch, causal over a padding mask built on the device.

    With ``prefix``, a batch whose sequences all have a recorded frozen-block output skips the
    frozen blocks; any other batch runs in full and records it in ``prefix`` for later forwards."""
    device = next(policy.parameters()).device
    lengths = [len(s.input_ids) for s in batch]
    packed = policy.lm.config._attn_implementation == SDPA
    if not packed and any(s.drops for s in batch):
        raise ValueError(f"sequences with turns dropped from the rollout's cache need textrl's attention "
                         f"({SDPA}); this model runs {policy.lm.config._attn_implementation!r}")
    # where each sequence starts in the forward's flat [rows x width] tokens
    width = sum(lengths) if packed else max(lengths)
    starts = [sum(lengths[:r]) for r in range(len(batch))] if packed else [r * width for r in range(len(batch))]
    # the forwards: consecutive sequences of up to PACK_TOKENS tokens each when packed, else one padded batch
    packs = token_packs(lengths, PACK_TOKENS) if packed else [(0, len(batch))]
    allowed = [a for s in batch for a in s.allowed]
    ints = ints_to_device({
        "ids": [t for s in batch for t in s.input_ids + ([] if packed else [pad_id] * (width - len(s.input_ids)))],
        "positions": [c for n in lengths for c in range(n)] if packed else list(range(width)),
        "lengths": lengths,
        "at": [start + c for start, s in zip(starts, batch) for c in s.positions],  # the hidden state each decision reads
        # each of those once, per forward: the last block's MLP runs there only (PolicyValueModel.last_mlp_at)
        **{f"read{k}": sorted({start - starts[i] + c for start, s in zip(starts[i:j], batch[i:j]) for c in s.positions})
           for k, (i, j) in enumerate(packs)},
        "chosen": [a.index(t) for a, t in zip(allowed, (t for s in batch for t in s.tokens))],
        "decisions": [k for s in batch for k in s.decisions],
        **fork_parts(allowed)}, device)
    hidden = []
    for k, (i, j) in enumerate(packs):
        part, first = batch[i:j], starts[i]
        if packed:  # one stream: each sequence's start hides every token before it
            n = sum(lengths[i:j])
            ids, positions = ints["ids"][first: first + n][None], ints["positions"][first: first + n][None]
            drops = [Drop(start - first + d.at, start - first + d.start, start - first + d.stop)
                     for start, s in zip(starts[i:j], part) for d in s.drops]
            drops += [Drop(start - first, 0, start - first) for start in starts[i + 1: j]]
            # a layout even for one sequence without cuts (one causal block): with it transformers builds
            # no mask of its own, which would read the positions on the host (PolicyValueModel.hidden)
            mask, extra = None, {"stream": StreamLayout.of([(n, tuple(drops))], device)}
        else:  # right padding: plain 0..n-1, as in the rollout
            ids, positions = ints["ids"].view(len(batch), width), ints["positions"][None].expand(len(batch), width)
            mask, extra = padding_mask(policy, ints["lengths"], width) if min(lengths) < width else None, {}
        extra["read"] = ints[f"read{k}"]
        hidden.append(_hidden(policy, part, [start - first for start in starts[i:j]], packed, prefix,
                              ids, mask, positions, extra).flatten(0, 1))
    h = (torch.cat(hidden) if len(hidden) > 1 else hidden[0])[ints["at"]]
    forks = Forks.on_device(allowed, ints)
    return ForkOutputs(policy.logits_of(h, forks.index), forks.valid, ints["chosen"], policy.value(h), sum(lengths),
                       ints["decisions"])


def token_packs(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive sequences, as ``(first, stop)`` index ranges, of at most ``budget`` tokens each (a
    longer sequence alone)."""
    packs, first, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > first and total + n > budget:
            packs.append((first, i))
            first, total = i, 0
        total += n
    return packs + [(first, len(lengths))]


def _hidden(policy: PolicyValueModel, part: list[TrainingSequence], starts: list[int], packed: bool,
            prefix: PrefixOutputs | None, ids, mask, positions, extra) -> torch.Tensor:
    """One forward of ``decision_forward`` over ``part`` (its sequences from ``starts`` in the packed
    row, or rows of the padded batch): the last layer's hidden states, the frozen blocks replayed
    from ``prefix`` where every sequence has a recording, else recorded into it."""
    if prefix is None:
        return policy.hidden(ids, mask, positions, **extra)[0]
    if all(prefix.outputs[s.index] is not None for s in part):
        outputs = [prefix.outputs[s.index] for s in part]
        # padded: zeros at the padding, which causal attention keeps out of every real position
        recorded = torch.cat(outputs)[None] if packed else torch.nn.utils.rnn.pad_sequence(outputs, batch_first=True)
        with prefix.frozen.replay(recorded):
            return policy.hidden(ids, mask, positions, **extra)[0]
    with prefix.frozen.record() as recorded:
        hidden, _ = policy.hidden(ids, mask, positions, **extra)
    output = prefix.frozen.recorded_output(recorded).flatten(0, 1)
    for start, s in zip(starts, part):
        prefix.outputs[s.index] = output[start: start + len(s.input_ids)].detach()
    return hidden


def padding_mask(policy: PolicyValueModel, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """The attention mask of right-padded rows of ``lengths`` (on the device). For SDPA, the
    4-D boolean mask itself (causal, padded keys masked), which transformers uses as given: from
    a 2-D mask it would build the same one, after reading the mask on the host twice to see whether
    it may skip it (two synchronisations per forward on a GPU). Other attention implementations
    (eager, flash attention) get the 2-D mask they build their own from."""
    position = torch.arange(width, device=lengths.device)
    real = position[None] < lengths[:, None]  # [rows, width]
    if policy.lm.config._attn_implementation not in ("sdpa", SDPA):
        return real.long()
    causal = position[None, :] <= position[:, None]  # [query, key]
    return (causal[None] & real[:, None, :])[:, None]  # [rows, 1, query, key]


def optimizer_steps(sequences: list[TrainingSequence], minibatch_size: int, grad_accum: int, epochs: int,
                    rng: random.Random) -> list[list[list[TrainingSequence]]]:
    """``epochs`` shuffled passes over the sequences, as optimizer steps of up to ``grad_accum``
    minibatches of ``minibatch_size`` sequences (each pass's last step may be smaller)."""
    steps = []
    for _ in range(epochs):
        order = list(range(len(sequences)))
        rng.shuffle(order)
        batches = [[sequences[j] for j in order[i: i + minibatch_size]] for i in range(0, len(order), minibatch_size)]
        steps += [batches[i: i + grad_accum] for i in range(0, len(batches), grad_accum)]
    return steps

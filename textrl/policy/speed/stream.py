"""Turns cut from a row's KV cache in the rollout, and the attention that reproduces it in the update.

When an episode's history is cut (``Game.step`` keeps half of ``env.history_len`` turns;
``PromptBuilder`` drops the oldest turns over ``env.max_prompt_tokens``), the next prompt is the
one the row holds less a stretch in its middle (the oldest turns after the system message), plus
the new observation (a cut on both sides of a turn ``env.keep_answers`` keeps takes two stretches:
``find_cut`` finds no single one, and that row starts again from position 0). Fed again from
position 0, a cut costs the whole prompt: on medium games
(32 steps, a cut every 4 turns) that was most of a rollout's tokens and of the update's. Instead
the decoder drops the cut turns' keys and values from the row's cache (``RaggedCache.drop``) and
feeds only the new tokens, at the positions after the row's last one. The row then holds exactly
the prompt's tokens, in order; what differs from feeding the prompt afresh is that the kept turns'
keys and values were computed while the cut ones were still there, and that positions go on
counting.

A row's *stream* is every token fed since it last started from position 0, in order, at positions
0, 1, 2, ...; ``Drop(at, start, stop)``: the stream's tokens ``start:stop`` are not seen by its
tokens from ``at`` on. The update runs one forward over a stream (a ``TrainingSequence`` with its
``drops``) in which each token attends to exactly the keys it attended to in the rollout:
``stream_attention``, one SDPA call per block of tokens between two cuts, over the keys that block
sees. Its cost is the rollout's (each block attends to about one prompt), not that of a dense mask
over the whole episode.

The decoder keeps turns only where the update can reproduce them: under textrl's own SDPA
attention (``textrl.policy.model.sdpa_attention`` routes a forward with a ``stream`` layout here)
and within the model's positions; elsewhere a cut row starts again from position 0, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.nn import functional as F

from textrl.policy.speed.cpu_attention import attend


class Drop(NamedTuple):
    at: int  # the first stream token that no longer sees them
    start: int  # the stream tokens start:stop
    stop: int


def find_cut(held: list[int], prompt: list[int]) -> tuple[int, int] | None:
    """``(s, e)`` such that ``prompt == held[:s] + held[e:] + new`` with ``s < e`` and at least one
    new token, dropping as little as possible (the smallest ``e``); None when no such cut exists.
    ``s`` is the common prefix: where a cut turn and the first kept one begin alike (a chat
    template's turn header), the same tokens are kept from the cut turn instead, which is the same
    prompt."""
    s = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        s += 1
    if s >= len(held):
        return None  # the prompt extends what is held: no cut
    first = prompt[s] if s < len(prompt) else None
    for e in range(s + 1, len(held)):
        kept = len(held) - e
        if held[e] == first and s + kept < len(prompt) and held[e:] == prompt[s: s + kept]:
            return s, e
    return None


def runs(indices: list[int]) -> list[tuple[int, int]]:
    """Sorted ints as ``(start, stop)`` ranges of consecutive values."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def blocks(length: int, drops: tuple[Drop, ...] | list[Drop]) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """The attention blocks of a stream of ``length`` tokens: ``(q0, q1, ranges)``, its tokens q0:q1
    between two cuts and the stream positions they may attend to, as ``(start, stop)`` ranges in
    order. Every key before q0 in them is seen by all of the block's tokens; the last range ends with
    the block itself, which is seen causally (a cut hides only tokens before it)."""
    cuts = sorted({d.at for d in drops if 0 < d.at < length})
    bounds = [0, *cuts, length]
    out = []
    for q0, q1 in zip(bounds, bounds[1:]):
        ranges, j = [], 0
        for a, b in sorted((d.start, d.stop) for d in drops if d.at <= q0):
            if a > j:
                ranges.append((j, a))
            j = max(j, b)
        ranges.append((j, q1))
        out.append((q0, q1, ranges))
    return out


@dataclass
class StreamLayout:
    """The attention blocks of a right-padded batch of streams (``streams``: each row's length and
    drops), for one forward: per row, ``blocks``' ranges and each block's mask, built once for
    every layer on the device: bottom-right causal (a block's earlier keys are all seen; its own
    tokens causally); None for a single query, and for a block that sees only itself (plain causal
    attention: the kernels' own ``is_causal``)."""

    rows: list[list[tuple[int, int, list[tuple[int, int]]]]]
    masks: list[list[torch.Tensor | None]]

    @classmethod
    def of(cls, streams: list[tuple[int, tuple[Drop, ...]]], device: torch.device) -> "StreamLayout":
        rows = [blocks(length, drops) for length, drops in streams]
        masks = []
        for row in rows:
            masks.append([])
            for q0, q1, ranges in row:
                m, n = q1 - q0, sum(b - a for a, b in ranges)
                masks[-1].append(None if m == 1 or m == n else torch.ones(m, n, dtype=torch.bool, device=device).tril(n - m))
        return cls(rows, masks)


def stream_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: StreamLayout,
                     scaling: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Attention over a batch of streams: ``query`` [rows, heads, width, dim], ``key``/``value``
    [rows, kv heads, width, dim] (right padded); returns [rows, width, heads, dim] as
    transformers' attention functions do, zeros at the padding (no decision reads it). A block's
    keys are slices of the row's (one range: a view; several: joined), so the backward adds their
    gradients back into slices, with no scatter."""
    rows, heads, width, dim = query.shape
    groups = heads // key.shape[1]
    cpu = query.device.type == "cpu"
    out = []
    for b, (row, masks) in enumerate(zip(layout.rows, layout.masks)):
        parts = []
        for (q0, q1, ranges), mask in zip(row, masks):
            k = torch.cat([key[b: b + 1, :, s:e] for s, e in ranges], dim=2) if len(ranges) > 1 else \
                key[b: b + 1, :, ranges[0][0]: ranges[0][1]]
            v = torch.cat([value[b: b + 1, :, s:e] for s, e in ranges], dim=2) if len(ranges) > 1 else \
                value[b: b + 1, :, ranges[0][0]: ranges[0][1]]
            q = query[b: b + 1, :, q0:q1]
            causal = mask is None and q1 - q0 > 1  # a block that sees only itself
            if cpu and not dropout:  # as the rollout's calls attend (SDPA, or products where faster in bf16)
                parts.append(attend(q, k, v, scaling, mask, causal))
                continue
            if groups > 1 and not cpu:  # CUDA's masked kernels take no grouped heads (see model.sdpa_attention)
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            parts.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                        is_causal=causal, enable_gqa=groups > 1 and cpu))
        end = row[-1][1] if row else 0
        if end < width:
            parts.append(query.new_zeros(1, heads, width - end, dim, dtype=parts[0].dtype if parts else query.dtype))
        out.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])  # one block: no copy
    return (torch.cat(out) if len(out) > 1 else out[0]).transpose(1, 2).contiguous()

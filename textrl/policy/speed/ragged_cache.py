"""The rollout decoder's KV cache: rows of different lengths, fed packed, with no padding in the linear layers.

The decoder feeds each row's new tokens -- a turn's observation (tens to hundreds of tokens), or the
one or two tokens after a fork -- and the rows' counts differ. Fed as one left-padded batch, a
sizeable share of the positions a rollout's model calls compute would be padding, and every padded
position would stay in the cache as a hole that later tokens attend over. Here a call is one packed sequence, every row's new tokens back to back
(``[1, tokens]``): the linear layers, most of the model, see real tokens only. Only attention is
per row, and transformers lets it be replaced (``AttentionInterface``): ``ragged_attention`` stores
each row's new keys and values after the row's own, and attends each row's queries to its own
keys only.

Storage: per layer one flat buffer of keys and one of values, ``[kv heads, capacity, head dim]``,
in which every row owns a contiguous stretch with room to grow, so a call writes only its new
tokens (``index_copy_``) and a row's keys are a view. When a row outgrows its stretch, all rows move
to new stretches with half again their length to spare (a copy of the cache, every
few turns; ``layout`` decides it, ``feeding`` copies). Rows leave by being forgotten; a row whose
history was cut either drops the cut turns (``drop``: the next call's copy moves the kept positions
together, so the cache never has holes; ``textrl.policy.speed.stream``) or starts again at length 0 in
its own stretch.

Attention per row is one call per row and layer (``textrl.policy.speed.cpu_attention.attend``: SDPA, or
in bf16 where this CPU runs them faster, plain matrix products): on a CPU, the cheapest (no padded
query or key is computed at all). On a GPU that is many small kernels for a wide batch, so there
(``batched``) one FlexAttention call per layer reads the cache in place: the rows' queries padded
to the call's widest row form the batch, the key and value buffers are one batch broadcast to all
rows (no copy, the key/value heads not repeated: ``enable_gqa``), and a block mask built from the
rows' stretches (``row_block_mask``) gives each row only the key blocks of its own stretch, masked
within them to its causal positions. The kernel reads whole blocks, so a block's positions outside
the row get a weight of 0: in this layout the buffers are zero-filled when allocated (``0 * NaN``
would be NaN). Compiled on CUDA (``flex``), eager elsewhere (the tests' CPU check). Both layouts
give the same result (tests/test_ragged_cache.py).
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from textrl.policy.speed.cpu_attention import attend
from textrl.policy.device import ints_to_device

KV_BLOCK = 128  # FlexAttention's key block: a row attends to the blocks its stretch touches
RAGGED = "textrl_ragged"  # the attention implementation a call runs under while it feeds a RaggedCache
# attention arguments some architectures pass that change what attention computes (Mistral's and
# Gemma's sliding windows, Gemma 2's logit soft-capping, attention sinks, T5-style biases)
UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "position_bias")


@dataclass
class CallLayout:
    """One call's layout, decided on the host (``RaggedCache.layout``)."""

    new: list[int]  # tokens appended to each row
    ends: list[int]  # each row's length after the call
    starts: list[int]  # each row's stretch in the buffers (new ones when rows were moved)
    room: list[int]
    spans: list[tuple[int, int, int, int]]  # per row fed: its queries q0:q1 in the call, its keys k0:k1
    width: int  # the most tokens a row is fed
    parts: dict[str, list[int]]  # the indices the call needs on the device


class RaggedCache:
    """Keys and values of ``rows`` sequences, each of its own length (module docstring)."""

    def __init__(self, rows: int, device: torch.device, batched: bool = False):
        self.device = torch.device(device)
        self.batched = batched  # one padded SDPA call per layer (GPU) instead of one per row
        self.lengths = [0] * rows  # positions each row holds
        self.starts = [0] * rows  # where each row's stretch begins in the buffers
        self.room = [0] * rows  # how long each row's stretch is
        self.capacity = 0
        self.keys: dict[int, torch.Tensor] = {}  # layer index -> [kv heads, capacity, head dim]
        self.values: dict[int, torch.Tensor] = {}
        self.kept: dict[int, list[int]] = {}  # row -> the offsets in its stretch it keeps after drops, until the next call moves them
        self._call = None  # the layout of the call in progress (``feeding``)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def select(self, rows: list[int]) -> None:
        """Keep these rows, in this order; the others' stretches are reclaimed at the next relayout."""
        self.lengths = [self.lengths[r] for r in rows]
        self.starts = [self.starts[r] for r in rows]
        self.room = [self.room[r] for r in rows]
        self.kept = {new: self.kept[old] for new, old in enumerate(rows) if old in self.kept}

    def restart(self, row: int) -> None:
        """Forget a row's positions: its next tokens are fed from position 0."""
        self.lengths[row] = 0
        self.kept.pop(row, None)

    def drop(self, row: int, start: int, stop: int) -> None:
        """Forget a row's positions ``start:stop`` (in the order it holds them); the others keep their
        keys, values and order. The next call's copy moves them together (``layout``)."""
        kept = self.kept.get(row, range(self.lengths[row]))
        self.kept[row] = [*kept[:start], *kept[stop:]]
        self.lengths[row] = len(self.kept[row])

    def layout(self, new: list[int]) -> "CallLayout":
        """The layout of one call that appends ``new[r]`` tokens to row r (the call's input packs them
        in row order), decided on the host: every index it needs on the device is an int list in
        ``CallLayout.parts``, which the caller copies together with its own in one transfer
        (``textrl.policy.device.ints_to_device``). A row that outgrows its stretch gives every row a
        stretch of what it will hold and half again (the copy runs in ``feeding``)."""
        if len(new) != self.rows:
            raise ValueError(f"{len(new)} rows fed, the cache has {self.rows}")
        ends = [n + k for n, k in zip(self.lengths, new)]
        parts: dict[str, list[int]] = {}
        starts, room = self.starts, self.room
        if self.kept or any(e > r for e, r in zip(ends, self.room)):  # rows dropped positions, or one outgrew its stretch
            room = [-(-(n + n // 2) // 64) * 64 for n in ends]
            starts = [0, *itertools.accumulate(room)][:-1]
            parts["relayout_src"] = [s + i for r, (s, n) in enumerate(zip(self.starts, self.lengths))
                                     for i in self.kept.get(r, range(n))]
            parts["relayout_dst"] = [i for s, n in zip(starts, self.lengths) for i in range(s, s + n)]
        parts["dest"] = [i for s, n, e in zip(starts, self.lengths, ends) for i in range(s + n, s + e)]
        offsets = [0]
        for k in new:
            offsets.append(offsets[-1] + k)
        # queries offsets[r]:offsets[r+1] attend to keys starts[r]:starts[r]+ends[r]
        spans = [(offsets[r], offsets[r + 1], starts[r], starts[r] + ends[r]) for r, k in enumerate(new) if k]
        width = max((q1 - q0 for q0, q1, _, _ in spans), default=0)
        if self.batched and spans:
            parts["q0"], parts["n"] = [q0 for q0, _, _, _ in spans], [q1 - q0 for q0, q1, _, _ in spans]
            parts["k0"], parts["length"] = [k0 for _, _, k0, _ in spans], [k1 - k0 for _, _, k0, k1 in spans]
            parts["packed"] = [b * width + i for b, (q0, q1, _, _) in enumerate(spans) for i in range(q1 - q0)]
        return CallLayout(new, ends, starts, room, spans, width, parts)

    @contextmanager
    def feeding(self, call: "CallLayout | list[int]", ints: dict[str, torch.Tensor] | None = None):
        """Inside, one model call appends ``call.new[r]`` tokens to row r and every layer's
        ``ragged_attention`` reads this layout. ``ints``: ``call.parts`` on the device (None: copied
        here, for a caller that has nothing of its own to send). The rows hold the tokens after."""
        if not isinstance(call, CallLayout):
            call = self.layout(call)
        if ints is None:
            ints = ints_to_device(call.parts, self.device)
        if "relayout_src" in ints:  # rows moved to their new stretches
            for store in (self.keys, self.values):
                for layer, old in store.items():
                    # kept rows copied here, new tokens in ``append``; the room to grow is never attended
                    # (``_buffer``: uninitialised per row, zeros in the batched layout, which reads whole blocks)
                    moved = self._buffer(old, old.shape[0], sum(call.room), old.shape[2])
                    moved[:, ints["relayout_dst"]] = old[:, ints["relayout_src"]]
                    store[layer] = moved
            self.capacity = sum(call.room)
            self.kept = {}
        self.starts, self.room = call.starts, call.room
        state = {"dest": ints["dest"], "spans": call.spans, "masks": []}
        if self.batched and call.spans:
            state.update(self._padded_layout(call, ints))
        else:  # bottom-right causal: new token i of k sees the row's first length - k + i + 1 positions
            state["masks"] = [None if q1 - q0 == 1 else
                              torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=self.device).tril(k1 - k0 - (q1 - q0))
                              for q0, q1, k0, k1 in call.spans]
        self._call = state
        try:
            yield
        finally:
            self._call = None
        self.lengths = call.ends

    def _padded_layout(self, call: "CallLayout", ints: dict[str, torch.Tensor]) -> dict:
        """The call's queries gathered into one padded batch and back (``batched``), and its block
        mask, computed on the device from the rows' sizes: a padded query repeats its row's last one
        (its output is dropped), so no query row is fully masked."""
        q0, n = ints["q0"], ints["n"]
        i = torch.minimum(torch.arange(call.width, device=self.device)[None], n[:, None] - 1)  # [rows, width]
        return {"q_index": q0[:, None] + i, "packed": ints["packed"],
                "block_mask": row_block_mask(ints["k0"], ints["length"], n, call.width, self.capacity)}

    def _buffer(self, like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A key or value buffer. Uninitialised in the per-row layout, which reads only positions
        written first (tests/test_ragged_cache.py fills the rest with NaN); zeros in the batched one,
        whose kernel reads whole key blocks and weighs the positions outside a row by 0."""
        make = like.new_zeros if self.batched else like.new_empty
        return make(*shape, dtype=dtype or like.dtype)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the call's new keys and values ``[kv heads, tokens, head dim]`` into the rows' stretches."""
        if layer not in self.keys:
            # under autocast, stored in its dtype: SDPA would cast every key it reads to it at every
            # call (the keys arrive in fp32, rotated by fp32 cos/sin); the same rounding, done once.
            # A cache lives within one autocast context: one rollout, one evaluation
            device = key.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else key.dtype
            self.keys[layer] = self._buffer(key, key.shape[0], self.capacity, key.shape[2], dtype=dtype)
            self.values[layer] = self._buffer(value, value.shape[0], self.capacity, value.shape[2], dtype=dtype)
        keys, values = self.keys[layer], self.values[layer]
        keys.index_copy_(1, self._call["dest"], key.to(keys.dtype))
        values.index_copy_(1, self._call["dest"], value.to(values.dtype))
        return keys, values


def ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, ragged=None, **kwargs):
    """Attention for a packed call over a ``RaggedCache`` (``ragged``): ``query``, ``key``,
    ``value`` are ``[1, heads, tokens, head dim]``, every row's new tokens back to back; returns
    ``[1, tokens, heads, head dim]`` as transformers' attention functions do."""
    if ragged is None or ragged._call is None:
        raise RuntimeError("textrl_ragged attention runs only inside RaggedCache.feeding (PolicyValueModel.hidden_packed)")
    for name in UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{type(module).__name__} passes {name}={kwargs[name]!r} to its attention, which the rollout "
                f"decoder's packed attention does not implement (it serves Llama, Qwen2 and GPT-2 style "
                f"full causal attention); use a model without it")
    keys, values = ragged.append(module.layer_idx, key[0], value[0])
    call, heads = ragged._call, query.shape[1]
    groups = heads // keys.shape[0]
    query = query.to(keys.dtype)  # what autocast does to it anyway; without autocast, the same dtype
    if ragged.batched:
        b, width = call["q_index"].shape
        q = query[0][:, call["q_index"].flatten()].unflatten(1, (b, width)).transpose(0, 1)  # [rows, heads, width, dim]
        # the buffers as one batch that every row's queries broadcast over: read in place
        out = flex(q.device)(q, keys[None], values[None], block_mask=call["block_mask"], scale=scaling,
                             enable_gqa=groups > 1)
        return out.transpose(1, 2).flatten(0, 1)[call["packed"]][None], None  # [1, tokens, heads, dim]
    outs = []
    for (q0, q1, k0, k1), mask in zip(call["spans"], call["masks"]):
        outs.append(attend(query[:, :, q0:q1], keys[None, :, k0:k1], values[None, :, k0:k1], scaling, mask))
    return torch.cat(outs, dim=2).transpose(1, 2), None


def row_block_mask(k0: torch.Tensor, length: torch.Tensor, n: torch.Tensor, width: int, capacity: int) -> BlockMask:
    """FlexAttention's mask for one batched call: batch row b is the cache row whose stretch starts
    at ``k0[b]`` and holds ``length[b]`` positions after the call, ``n[b]`` of them new; its query i
    (``i >= n[b]``: padding, repeating the last) sees positions ``k0[b]`` to ``k0[b] + length[b] -
    n[b] + i`` of the buffers (bottom-right causal). Only the key blocks the stretch touches are
    listed, so the kernel skips every other row's; built from the sizes, on their device, without
    evaluating the mask over the whole buffer."""
    rows, device = k0.shape[0], k0.device
    blocks = -(-capacity // KV_BLOCK)
    first, last = k0 // KV_BLOCK, (k0 + length - 1) // KV_BLOCK
    q_blocks = -(-width // KV_BLOCK)
    indices = torch.clamp(first[:, None] + torch.arange(blocks, device=device)[None], max=blocks - 1)
    kv_num_blocks = (last - first + 1)[:, None, None].expand(rows, 1, q_blocks).to(torch.int32).contiguous()
    kv_indices = indices[:, None, None, :].expand(rows, 1, q_blocks, blocks).to(torch.int32).contiguous()
    last_seen = k0 + length - n  # what query 0 sees last

    def mask_mod(b, h, q, kv):
        return (kv >= k0[b]) & (kv <= last_seen[b] + torch.minimum(q, n[b] - 1))

    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(KV_BLOCK, KV_BLOCK), mask_mod=mask_mod,
                                    seq_lengths=(width, capacity), compute_q_blocks=False)


_compiled_flex = None


def flex(device: torch.device):
    """FlexAttention for the batched layout: compiled on CUDA (eager, it would compute every key of
    the buffers for every query), eager elsewhere, where only the tests run it."""
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention
    if _compiled_flex is None:  # the call's widths and the buffers' length change from call to call
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


@contextmanager
def routed_to_ragged(config):
    """Inside, the model's attention layers call ``ragged_attention``; transformers builds no mask
    for it (no mask function is registered under ``RAGGED``)."""
    from transformers import AttentionInterface  # slow import: see textrl.policy.model.load_lm

    AttentionInterface.register(RAGGED, ragged_attention)
    saved = config._attn_implementation
    config._attn_implementation = RAGGED
    try:
        yield
    finally:
        config._attn_implementation = saved

"""The rollout decoder's packed calls over a ``RaggedCache``: every row computes what it computes
alone, through relayouts, rows leaving and rows starting again, on the per-row (CPU) and the
batched (GPU) attention path alike."""

import pytest
import torch

from textrl.games.env import TextGame
from textrl.policy.speed.ragged_cache import RaggedCache


def real_prompts(prompts, easy_games, n):
    out = []
    for path in easy_games[:n]:
        env = TextGame(path, 8)
        env.reset()
        out.append(prompts.build(env.observation, env.history))
    return out


def alone(policy, tokens):
    """Hidden states of one row fed whole, without a cache."""
    ids = torch.tensor([tokens])
    hidden, _ = policy.hidden(ids, torch.ones_like(ids), torch.arange(len(tokens))[None])
    return hidden[0]


def feed(policy, cache, fed, chunks):
    """One packed call appending ``chunks[r]`` to row r; returns each row's new hidden states."""
    ids = torch.tensor([[t for c in chunks for t in c]])
    positions = torch.tensor([[k for f, c in zip(fed, chunks) for k in range(len(f), len(f) + len(c))]])
    hidden = policy.hidden_packed(ids, positions, cache, [len(c) for c in chunks])[0]
    out, offset = [], 0
    for f, c in zip(fed, chunks):
        out.append(hidden[offset:offset + len(c)])
        offset += len(c)
        f.extend(c)
    return out


def poison_room(cache):
    """NaN at every buffer position no row holds (the buffers are left uninitialised there): a call
    that read any of it would give NaN hidden states. The batched layout reads whole key blocks
    (weighing positions outside a row by 0) from zero-filled buffers: a large finite value there,
    which a call that attended to any of it would not return unchanged."""
    assert not cache.batched or all(b.isfinite().all() for store in (cache.keys, cache.values) for b in store.values())
    held = torch.zeros(cache.capacity, dtype=torch.bool)
    for start, length in zip(cache.starts, cache.lengths):
        held[start:start + length] = True
    assert not held.all()  # there is room to poison
    for store in (cache.keys, cache.values):
        for buffer in store.values():
            buffer[:, ~held] = 1e4 if cache.batched else float("nan")


@pytest.mark.parametrize("batched", [False, True], ids=["per-row", "batched"])
@torch.no_grad()
def test_packed_calls_compute_what_each_row_computes_alone(tiny, prompts, easy_games, batched):
    policy, _ = tiny
    texts = real_prompts(prompts, easy_games, 16)
    rows = [sum(texts[r::4], []) for r in range(4)]  # four real prompts back to back per row
    assert min(len(r) for r in rows) > 300  # every chunk below is real tokens
    cache = RaggedCache(3, "cpu", batched=batched)
    fed = [[], [], []]
    got = [[], [], []]
    # unequal chunks, a row fed nothing, single tokens (a fork call); the rows outgrow their
    # stretches (room is 1.5x the first call's need) and move
    plan = [[40, 7, 90], [60, 0, 1], [1, 2, 1], [150, 180, 30]]  # sums <= 275 per row
    for sizes in plan:
        chunks = [rows[r][len(fed[r]):len(fed[r]) + k] for r, k in enumerate(sizes)]
        for r, h in enumerate(feed(policy, cache, fed, chunks)):
            got[r].append(h)
        poison_room(cache)
    assert cache.lengths == [len(f) for f in fed] and len(fed[1]) > 64  # row 1's first stretch was 64 long
    for r in range(3):
        assert torch.allclose(torch.cat(got[r]), alone(policy, fed[r]), atol=1e-5)

    # row 1 leaves; row 2 (now row 0) starts again with another prompt while row 0 (now row 1) goes on
    cache.select([2, 0])
    fed = [[], fed[0]]
    cache.restart(0)
    poison_room(cache)  # row 1's old stretch and row 0's old positions too
    held = len(fed[1])
    new = feed(policy, cache, fed, [rows[3][:120], rows[0][held:held + 25]])
    assert cache.lengths == [120, held + 25]
    assert torch.allclose(new[0], alone(policy, fed[0]), atol=1e-5)
    assert torch.allclose(new[1], alone(policy, fed[1])[-25:], atol=1e-5)


@torch.no_grad()
def test_under_autocast_the_cache_holds_keys_in_its_dtype_with_the_same_bits(tiny, prompts, easy_games):
    """Keys arrive in fp32 (rotated by fp32 cos/sin) and SDPA casts them under autocast at every
    call; the cache stores them cast once, and the kernel computes the same bits from them."""
    policy, _ = tiny
    (row,) = real_prompts(prompts, easy_games, 1)
    cache = RaggedCache(1, "cpu")
    with torch.autocast("cpu", torch.bfloat16):
        feed(policy, cache, [[]], [row])
    assert {k.dtype for k in cache.keys.values()} == {torch.bfloat16}
    q, k, v = (torch.randn(1, 4, n, 16) for n in (5, 30, 30))
    mask = torch.ones(5, 30, dtype=torch.bool).tril(25)
    with torch.autocast("cpu", torch.bfloat16):
        fp32_keys = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        bf16_keys = torch.nn.functional.scaled_dot_product_attention(q, k.bfloat16(), v.bfloat16(), attn_mask=mask)
    assert torch.equal(fp32_keys, bf16_keys)


def test_attention_outside_a_feeding_call_is_refused(tiny):
    policy, _ = tiny
    from textrl.policy.speed.ragged_cache import ragged_attention

    layer = policy.lm.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match="RaggedCache.feeding"):
        ragged_attention(layer, *(torch.zeros(1, 2, 3, 4) for _ in range(3)), None, ragged=RaggedCache(1, "cpu"))


def test_an_attention_argument_it_does_not_implement_is_refused_by_name(tiny):
    """A sliding window ignored would attend further back than the update's forward does."""
    policy, _ = tiny
    from textrl.policy.speed.ragged_cache import ragged_attention

    cache = RaggedCache(1, "cpu")
    layer = policy.lm.model.layers[0].self_attn
    with cache.feeding([3]), pytest.raises(NotImplementedError, match="sliding_window=4096"):
        ragged_attention(layer, *(torch.zeros(1, 2, 3, 4) for _ in range(3)), None, ragged=cache, sliding_window=4096)

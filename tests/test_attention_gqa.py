"""The CPU attention path (``textrl.policy.model.sdpa_attention``): grouped-query attention in the
kernel instead of transformers' copies of the key/value heads, with the same result."""

import contextlib

import pytest
import torch

from textrl.games.env import TextGame
from textrl.policy.model import SDPA


def padded_batch(prompts, easy_games):
    """Two real prompts, left-padded into one batch with a mask (as a minibatch of several sequences)."""
    rows = []
    for path in easy_games[:2]:
        env = TextGame(path, 8)
        env.reset()
        rows.append(prompts.build(env.observation, env.history))
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    assert mask.sum() < mask.numel()  # the prompts differ in length: there is padding to mask
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def run(policy, implementation, ids, mask, positions, autocast):
    """Hidden states, the gradient of the top block's query weights, and the key heads the CPU
    attention kernel was given."""
    policy.lm.config._attn_implementation = implementation
    policy.zero_grad(set_to_none=True)
    with torch.profiler.profile(record_shapes=True) as prof, autocast:
        hidden, _ = policy.hidden(ids, mask, positions)
    hidden.float().square().mean().backward()
    grad = policy.lm.model.layers[-1].self_attn.q_proj.weight.grad.clone()
    kernel = [e for e in prof.events() if e.name == "aten::_scaled_dot_product_flash_attention_for_cpu"]
    key_heads = {e.input_shapes[1][1] for e in kernel}
    return hidden.detach(), grad, key_heads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_gqa_attention_equals_transformers_sdpa(tiny, prompts, easy_games, precision):
    policy, _ = tiny
    config = policy.lm.config
    assert config._attn_implementation == SDPA  # what build_policy chose
    assert config.num_key_value_heads < config.num_attention_heads  # the tiny model groups its queries
    autocast = torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    batch = padded_batch(prompts, easy_games)
    try:
        ours, ours_grad, ours_heads = run(policy, SDPA, *batch, autocast)
        theirs, theirs_grad, theirs_heads = run(policy, "sdpa", *batch, autocast)
    finally:
        config._attn_implementation = SDPA
        policy.zero_grad(set_to_none=True)
    # the kernel got the key/value heads as they are, where transformers repeats them per query group
    assert ours_heads == {config.num_key_value_heads}
    assert theirs_heads == {config.num_attention_heads}
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-5, atol=1e-7)

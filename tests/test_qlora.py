"""QLoRA (``memory=qlora``) for real on a CPU: bitsandbytes >= 0.50 quantises to 4-bit NF4 and runs
its kernels there, so the whole path runs here: training through ``train()``, textrl-play,
textrl-attention and textrl-eval on the checkpoint with everything on the policy's device, and
textrl-export to a plain fp32 model. The model is the tiny random Llama, saved to a directory and
loaded from it like a pretrained model (``model.source=hub model.path=DIR``): 4-bit weights are
quantised as a model loads, so ``model.source=random`` is refused. Also: the 8-bit optimizer keeps
the value head's states in 32 bits.
"""

from __future__ import annotations

from contextlib import contextmanager

import bitsandbytes as bnb
import pytest
import torch

import textrl.cli.attention as attention_cli
import textrl.cli.evaluate as evaluate_cli
import textrl.cli.play as play_cli
import textrl.cli.train as cli
import textrl.policy.loading as loading
from tests.conftest import config
from textrl.config import ConfigError, MemoryConfig, load_model_config
from textrl.policy.checkpoint import load_checkpoint_policy
from textrl.policy.memory import make_optimizer
from textrl.policy.model import build_policy

QLORA = MemoryConfig(name="qlora", lora=True, quantize_4bit=True, grad_ckpt=True, precision="bf16-mixed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny random Llama and its tokenizer, saved as a model directory."""
    folder = tmp_path_factory.mktemp("tiny_model")
    policy, tokenizer = build_policy(load_model_config("tiny"))
    policy.lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def qlora_config(run, model_dir, *overrides):
    return config(run, "memory=qlora", "model.source=hub", f"model.path={model_dir}", *overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, model_dir):
    run = tmp_path_factory.mktemp("qlora_run")
    return cli.train(qlora_config(run, model_dir, "iterations=1", "eval.before_training=false", "eval.transcripts=0"))


def four_bit_layers(lm) -> list:
    return [m for m in lm.modules() if isinstance(m, bnb.nn.Linear4bit)]


def devices_of(policy) -> set[torch.device]:
    return {t.device for t in [*policy.parameters(), *policy.buffers()]}


class Asked:
    """Records each call of the real function it wraps (the answer is the real one)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@contextmanager
def inputs_checked_against_each_modules_device():
    """Every forward of a module that holds parameters: the devices of its tensor inputs that are
    not on the device of its parameters (a model on a GPU fed CPU tensors fails exactly there)."""
    wrong = []

    def check(module, args):
        own = {p.device for p in module.parameters(recurse=False)}
        for arg in args:
            if torch.is_tensor(arg) and own and arg.device not in own:
                wrong.append((type(module).__name__, arg.device, own))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(check)
    try:
        yield wrong
    finally:
        handle.remove()


def test_qlora_with_a_randomly_initialised_model_is_refused(tmp_path):
    # model=tiny is built with from_config, which takes no quantisation: it trained an fp32 LoRA model
    with pytest.raises(ConfigError, match=r"memory.quantize_4bit=True \(memory=qlora\) is not allowed with "
                                          r"model.source=random"):
        config(tmp_path, "memory=qlora")


def test_qlora_trains_on_the_cpu_with_4bit_base_weights(trained):
    module = trained["module"]
    policy = module.policy
    layers = four_bit_layers(policy.lm)
    # every LoRA target of the 2 blocks (7 per block) is a 4-bit layer holding packed uint8 weights
    assert len(layers) == 14 and all(m.weight.dtype == torch.uint8 for m in layers)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in policy.named_parameters())  # it trained
    assert policy.lm.is_gradient_checkpointing
    assert len(devices_of(policy)) == 1


def test_gradients_flow_through_the_4bit_layers_after_a_rollout(model_dir):
    """A rollout runs the policy in eval mode without gradients. On CPUs with AVX512-BF16,
    bitsandbytes then repacked the 4-bit weights into an inference layout without a backward, and
    the update's gradients through the frozen 4-bit layers were silently dropped (``load_lm`` turns
    that off). Elsewhere this holds either way."""
    cfg = load_model_config("tiny", source="hub", path=str(model_dir))
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1])[None]

    def lowest_lora_gradients(rollout_first: bool) -> torch.Tensor:
        torch.manual_seed(0)  # the same adapter initialisation both times
        policy, _ = build_policy(cfg, memory=QLORA)
        with torch.no_grad():  # lora_B starts at zero: give it a value so gradients reach lora_A too
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02)
        if rollout_first:
            policy.eval()
            with torch.no_grad():
                policy.hidden(ids, mask, positions)
        policy.train()
        hidden, _ = policy.hidden(ids, mask, positions)
        hidden.float().square().sum().backward()
        lowest = next(n for n, _ in policy.named_parameters() if "layers.0." in n and "lora_A" in n)
        return dict(policy.named_parameters())[lowest].grad

    fresh, after_rollout = lowest_lora_gradients(False), lowest_lora_gradients(True)
    assert fresh.abs().sum() > 0
    assert torch.allclose(after_rollout, fresh)


def test_a_qlora_checkpoint_plays_attends_and_evaluates_on_the_policys_device(trained, model_dir, easy_games,
                                                                              tmp_path, monkeypatch, capsys):
    last, game = trained["last"], easy_games[0]
    # the 4-bit policy itself (not an unquantised rebuild), everything on the device it was loaded on
    policy, _, cfg = load_checkpoint_policy(last, model_path=model_dir, device=play_cli.process_device())
    assert cfg.memory.quantize_4bit and len(four_bit_layers(policy.lm)) == 14
    assert devices_of(policy) == {play_cli.process_device()}
    tuned, base, _, _ = attention_cli.load_models(last, None, model_path=str(model_dir))
    assert len(four_bit_layers(tuned.lm)) == 14 and devices_of(tuned) == devices_of(base) == {play_cli.process_device()}

    # each command places its policy where process_device says (itself, or through the shared loader)
    asked = Asked(loading.process_device)
    for module in (loading, play_cli):
        monkeypatch.setattr(module, "process_device", asked)
    calls = {}
    with inputs_checked_against_each_modules_device() as wrong:
        before = asked.calls
        assert play_cli.main(["--checkpoint", str(last), "--model-path", str(model_dir), "--game-file", str(game),
                              "--top", "2"]) == 0
        calls["play"], before = asked.calls - before, asked.calls
        played = [line for line in capsys.readouterr().out.splitlines() if line.startswith("> ")]
        assert played
        out = tmp_path / "attention"
        assert attention_cli.main(["--checkpoint", str(last), "--model-path", str(model_dir), "--game-file", str(game),
                                   "--out", str(out)]) == 0
        calls["attention"], before = asked.calls - before, asked.calls
        assert (out / "attention.json").is_file()
        out = tmp_path / "eval"
        assert evaluate_cli.main(["--checkpoint", str(last), "--model-path", str(model_dir), "--games", str(game),
                                  "--max-steps", "3", "--batch", "1", "--out", str(out)]) == 0
        calls["eval"] = asked.calls - before
        assert (out / "results.json").is_file()
    assert not wrong
    assert all(n >= 1 for n in calls.values()), calls


def test_export_of_a_qlora_checkpoint_is_a_plain_fp32_model(trained, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from textrl.cli.export import main as export_main

    out = tmp_path / "exported"
    assert export_main([str(trained["last"]), str(out), "--model-path", str(model_dir)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out)  # no quantization_config
    assert getattr(merged.config, "quantization_config", None) is None
    assert not four_bit_layers(merged) and not any("lora" in n for n, _ in merged.named_parameters())
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    assert (out / "value_head.safetensors").is_file()
    # the adapters merged onto the unquantised base: what the same adapters compute on that base
    unquantised, tokenizer, _ = load_checkpoint_policy(trained["last"], model_path=model_dir, quantize=False)
    assert not four_bit_layers(unquantised.lm)
    ids = torch.tensor([tokenizer.encode("You are in a kitchen. There is a key here.")])
    mask, positions = torch.ones_like(ids), torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        expected = unquantised.logits(unquantised.hidden(ids, mask, positions)[0])
        assert torch.allclose(merged(ids).logits, expected, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(model_dir)
        assert not torch.allclose(base(ids).logits, expected, atol=1e-4)  # the adapters did change it


def test_the_8bit_optimizer_keeps_the_value_heads_states_in_32_bits(monkeypatch):
    """``memory.optimizer=adamw8bit``: the LM's Adam states are 8-bit (uint8, with their
    quantisation maps), the value head's 32-bit. bitsandbytes <= 0.49 applies the override only to
    registered parameters: make_optimizer registers them (checked in the manager's index table)."""
    manager = bnb.optim.GlobalOptimManager.get_instance()
    monkeypatch.setattr(manager, "pid2config", {})  # no other test's overrides (restored after)
    monkeypatch.setattr(manager, "index2config", {})
    torch.manual_seed(0)
    # a value head of 64 x 128 weights: bitsandbytes keeps tensors under 4096 values in 32 bits anyway
    policy, _ = build_policy(load_model_config("tiny", value_hidden=128))
    lm_params = [p for p in policy.lm.parameters() if p.requires_grad]
    value_params = list(policy.value_head.parameters())
    optimizer = make_optimizer(lm_params, value_params, MemoryConfig(optimizer="adamw8bit"), 1e-4, 1e-3, 0.0)
    for i, p in enumerate(value_params):  # registered by (group 1: the value head, index)
        assert manager.index2config[(1, i)] == {"optim_bits": 32}
    ids = torch.tensor([[1, 5, 7, 9, 11, 13]])
    hidden, _ = policy.hidden(ids, torch.ones_like(ids), torch.arange(6)[None])
    (policy.logits(hidden[:, -1]).logsumexp(-1).sum() + policy.value(hidden).square().sum()).backward()
    optimizer.step()
    big_lm = [p for p in lm_params if p.numel() >= 4096]
    assert big_lm and all(optimizer.state[p]["state1"].dtype == torch.uint8 and "qmap1" in optimizer.state[p]
                          for p in big_lm)
    big_value = [p for p in value_params if p.numel() >= 4096]
    assert big_value and all(optimizer.state[p]["state1"].dtype == torch.float32 and "qmap1" not in optimizer.state[p]
                             for p in big_value)

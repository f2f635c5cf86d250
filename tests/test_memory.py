"""Every memory option that can run on a CPU: one PPO iteration runs, parameters change, the
first-minibatch ratio stays at 1. GPU-only options fail at start with a clear message."""

import csv

import pytest
import torch

import textrl.cli.train as cli
from textrl.config import ConfigError, MemoryConfig
from textrl.policy.checkpoint import load
from textrl.policy.memory import make_optimizer
from tests.conftest import Snapshot, config

# fp32: rollout and update agree to 1e-4 on every decision. Under bf16 they round differently
# (chunked KV cache vs one full forward), so the old log-probs are recomputed with the update's own
# forward (ppo.recompute_old): the first minibatch is then the same computation again.
RATIO_TOL = {"32-true": 1e-4, "bf16-mixed": 1e-4, "16-mixed": 1e-4}


@pytest.mark.parametrize("memory, extra", [
    ("adam8bit", []), ("bf16", []), ("grad_ckpt", []), ("lora", []),
    ("lowmem", ["memory.precision=bf16-mixed"]),
])
def test_memory_option_runs_an_iteration_and_updates(tmp_path, memory, extra):
    check_memory_option(tmp_path, memory, extra)


def check_memory_option(tmp_path, memory: str, extra: list[str]) -> dict:
    """One iteration with ``memory=<memory>``: it trains what the option says, changes the weights
    and starts the update at ratio 1 (also run on a GPU by tests/test_cuda.py). Returns the
    iteration's metrics row."""
    cfg = config(tmp_path, f"memory={memory}", "iterations=1", "eval.every=1", *extra)
    snapshot = Snapshot()
    result = cli.train(cfg, callbacks=[snapshot])
    module = result["module"]
    cfg = module.cfg  # the run's resolved config: memory=auto's precision decided
    policy = module.policy
    if memory in {"lora", "qlora"}:
        trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    if memory in {"adam8bit", "lowmem"}:
        state = module.optimizers().optimizer.state
        assert any(v.dtype == torch.uint8 for s in state.values() for v in s.values() if torch.is_tensor(v))
    if memory in {"grad_ckpt", "lowmem"}:
        assert policy.lm.is_gradient_checkpointing
    changed = snapshot.changed(module)
    assert any(k.startswith("value_head.") for k in changed)
    if memory in {"lora", "qlora"}:  # lora_B starts at zero: it must have left it
        assert any("lora_B" in k for k in changed) and all("lora_" in k or "value_head" in k for k in changed)
    else:
        assert any(k.startswith("lm.") for k in changed)
    with open(tmp_path / "logs" / "metrics.csv") as f:
        row = next(r for r in csv.DictReader(f) if r.get("policy/first_logratio_max"))
    assert float(row["policy/first_logratio_max"]) < RATIO_TOL[cfg.memory.precision]
    if cfg.memory.precision == "bf16-mixed":  # recomputed: the gap it closed is logged (0 where a CPU rounds both alike)
        assert cfg.ppo.recompute_old and row.get("policy/rollout_logratio_max")
        assert 0 <= float(row["policy/rollout_logratio_max"]) < float("inf")
    return row


def test_lora_checkpoint_holds_adapters_and_head_only(tmp_path):
    result = cli.train(config(tmp_path, "memory=lora", "iterations=1"))
    state = load(result["last"])["state_dict"]
    assert state and all("lora_" in k or k.startswith("policy.value_head.") for k in state)
    resumed = cli.train(config(tmp_path / "r", "memory=lora", "iterations=2", f"ckpt_path={result['last']}"))
    assert resumed["trainer"].current_epoch == 2


@pytest.mark.parametrize("memory, key", [("fp16", "memory.precision"), ("lowmem", "memory.precision")])
def test_gpu_only_options_fail_at_start_on_a_cpu(tmp_path, memory, key):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match=f"{key}=.*needs a CUDA GPU"):
        config(tmp_path, f"memory={memory}", "model.trainable_layers=null")


def test_lora_turns_off_partial_block_training_and_refuses_it_when_asked(tmp_path):
    assert config(tmp_path, "memory=lora", "model=smollm2").model.trainable_layers is None
    with pytest.raises(ConfigError, match="model.trainable_layers=4 is not allowed"):
        config(tmp_path, "memory=lora", "model=smollm2", "model.trainable_layers=4")


def test_lora_checkpoint_merges_for_export(tmp_path):
    from transformers import AutoModelForCausalLM

    from textrl.cli.export import export, load_checkpoint_policy

    result = cli.train(config(tmp_path, "memory=lora", "iterations=1"))
    policy, tokenizer, _ = load_checkpoint_policy(result["last"])
    trained = result["module"].policy
    ids = torch.tensor([tokenizer.encode("You are in a kitchen. There is a key here.")])
    mask, pos = torch.ones_like(ids), torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        expected = trained.logits(trained.hidden(ids, mask, pos)[0])
        assert torch.allclose(policy.logits(policy.hidden(ids, mask, pos)[0]), expected, atol=1e-5)
        out = export(result["last"], tmp_path / "exported")
        merged = AutoModelForCausalLM.from_pretrained(out)
        assert not any("lora" in n for n, _ in merged.named_parameters())
        assert torch.allclose(merged(ids).logits, expected, atol=1e-4)
    assert (out / "value_head.safetensors").is_file()


@pytest.mark.parametrize("precision, fused", [("32-true", True), ("bf16-mixed", True), ("16-mixed", None)])
def test_adamw_is_fused_except_under_fp16_loss_scaling(precision, fused):
    # fused: one kernel per step instead of torch's per-tensor loop on a CPU (bench/optimizer.py); not
    # with 16-mixed, whose warm start clips through Fabric, which refuses optimizers that unscale inside step()
    layer = torch.nn.Linear(4, 4)
    optimizer = make_optimizer(list(layer.parameters()), [], MemoryConfig(precision=precision), 1e-3, 1e-3, 0.0)
    assert optimizer.defaults["fused"] is fused
    layer(torch.ones(1, 4)).sum().backward()
    before = layer.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(layer.weight, before)

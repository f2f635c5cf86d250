"""Memory options applied to the LM: gradient checkpointing, LoRA / QLoRA, 8-bit AdamW.

Mixed precision is Lightning's (``memory.precision``); everything else is here, through the
library that does it: transformers' gradient checkpointing, PEFT's LoRA, bitsandbytes' 4-bit
weights and 8-bit optimizer.
"""

from __future__ import annotations

import torch
from torch import nn

# Linear layers LoRA adapts, per model family (config.model_type).
LORA_TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}


def lora_targets(model_type: str, configured: list[str] | None) -> list[str]:
    if configured:
        return list(configured)
    if model_type not in LORA_TARGETS:
        raise ValueError(f"no default LoRA target modules for model type {model_type!r}; set "
                         f"memory.lora_targets=[...] to the names of its linear layers")
    return LORA_TARGETS[model_type]


def quantization_config(memory):
    """bitsandbytes 4-bit (NF4) loading for QLoRA, or None."""
    if not memory.quantize_4bit:
        return None
    from transformers import BitsAndBytesConfig  # slow import, and QLoRA is the one user

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def apply_memory(lm: nn.Module, memory) -> nn.Module:
    """Gradient checkpointing and LoRA adapters; returns the (possibly wrapped) LM."""
    if memory.quantize_4bit:
        from peft import prepare_model_for_kbit_training  # slow import: only QLoRA needs it

        lm = prepare_model_for_kbit_training(lm, use_gradient_checkpointing=memory.grad_ckpt,
                                             gradient_checkpointing_kwargs={"use_reentrant": False})
    elif memory.grad_ckpt:
        # non-reentrant: works with frozen inputs and keyword arguments; rollouts and evaluation run
        # in eval mode, where transformers skips checkpointing
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if memory.lora:
        from peft import LoraConfig, get_peft_model  # slow import: only LoRA needs it

        config = LoraConfig(r=memory.lora_r, lora_alpha=memory.lora_alpha, lora_dropout=0.0, bias="none",
                            target_modules=lora_targets(lm.config.model_type, memory.lora_targets),
                            task_type="CAUSAL_LM")  # dropout 0: the PPO ratio must be 1 on fresh data
        lm = get_peft_model(lm, config)
    return lm


def make_optimizer(lm_params: list, value_params: list, memory, lr_lm: float, lr_value: float, weight_decay: float):
    """AdamW over two parameter groups (LM, value head); with ``adamw8bit`` the LM states are 8-bit."""
    groups = [{"params": lm_params, "lr": lr_lm, "name": "lm"},
              {"params": value_params, "lr": lr_value, "name": "value"}]
    if memory.optimizer == "adamw":
        # fused: one kernel over every tensor instead of a Python loop of small ops per tensor (torch's
        # default on a CPU): measured faster on a CPU (bench/optimizer.py, docs/results.md), and on
        # CUDA it is the fastest of torch's implementations.
        # Not under 16-mixed: a fused step unscales inside itself, and Fabric (the warm start) refuses
        # to clip the gradients of such an optimizer
        fused = memory.precision != "16-mixed" and all(
            p.device.type in ("cpu", "cuda") for group in groups for p in group["params"])
        return torch.optim.AdamW(groups, weight_decay=weight_decay, fused=fused or None)
    import bitsandbytes as bnb  # slow import that probes for CUDA: only the 8-bit optimizer needs it

    manager = bnb.optim.GlobalOptimManager.get_instance()
    for param in value_params:  # the small value head keeps 32-bit states
        manager.override_config(param, "optim_bits", 32)
    # bitsandbytes <= 0.49 reads overrides only by (group, parameter) index, which register_parameters
    # fills from the overrides made so far: without it the value head silently got 8-bit states there
    # (0.50 also looks overrides up by parameter). The group dicts, so the indices are (group, param).
    manager.register_parameters(groups)
    return bnb.optim.AdamW8bit(groups, weight_decay=weight_decay)

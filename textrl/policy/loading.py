"""The policy that textrl-eval, textrl-play and textrl-attention play or inspect: a trained one from
its checkpoint, or an untrained model by its config, on the device it runs on, with the precision
it plays under."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple, Optional

import torch

from textrl.config import ModelConfig, TrainConfig, load_model_config
from textrl.policy.checkpoint import load_checkpoint_policy
from textrl.policy.device import process_device
from textrl.policy.model import PolicyValueModel, build_policy


class LoadedPolicy(NamedTuple):
    policy: PolicyValueModel
    tokenizer: object
    cfg: Optional[TrainConfig]  # the checkpoint's training config; None for an untrained model
    # the autocast it plays under: a checkpoint's memory.precision (what it was trained and evaluated
    # with); "auto" for an untrained model, decided on it as training decides it (autocast_context)
    precision: str


def load_policy(checkpoint: str | None = None, model: str | ModelConfig | None = None, *, option: str = "checkpoint",
                cache_dir: str | None = None, model_path: str | None = None, device: str | torch.device | None = None,
                attn_implementation: str | None = None) -> LoadedPolicy:
    """The policy of ``checkpoint`` (``option`` names it in errors; ``model_path``: the model directory
    it was trained from, given by the user), else the untrained ``model`` (a model option's name or
    config), in eval mode on ``device`` (None: ``process_device()``, this process's GPU as training
    picks it, else the CPU). Models are converted into the user's ``cache_dir``, never a directory a
    checkpoint names. ``attn_implementation`` overrides the model's (textrl-attention: eager, which
    returns attention weights)."""
    device = torch.device(device) if device is not None else process_device()
    if checkpoint is not None:
        policy, tokenizer, cfg = load_checkpoint_policy(checkpoint, option, cache_dir, model_path, device,
                                                        attn_implementation=attn_implementation)
        precision = cfg.memory.precision
    else:
        model_cfg = load_model_config(model) if isinstance(model, str) else model
        if attn_implementation is not None:
            model_cfg = replace(model_cfg, attn_implementation=attn_implementation)
        policy, tokenizer = build_policy(model_cfg, cache_dir=cache_dir)
        cfg, precision = None, "auto"
    # a QLoRA policy was loaded onto the device; any other is moved there (every input follows the policy)
    return LoadedPolicy(policy.to(device).eval(), tokenizer, cfg, precision)

"""The initial policy that the KL anchor (``ppo.kl_coef``) measures the policy against.

No second copy of the model: with LoRA the reference is the base model with the adapters switched
off; otherwise it is a copy of the *trainable* LM parameters only (with ``model.trainable_layers=6``,
SmolLM2's top 6 blocks), swapped into the model for the reference forward and swapped back after.
The copy is a buffer of the LightningModule, so checkpoints keep it and a resumed run anchors to
the same initial policy.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


class ReferencePolicy(nn.Module):
    def __init__(self, lm: nn.Module, lora: bool):
        super().__init__()
        self.lora = lora
        self.names = [] if lora else [n for n, p in lm.named_parameters() if p.requires_grad]
        params = dict(lm.named_parameters())
        for i, name in enumerate(self.names):
            self.register_buffer(f"param_{i}", params[name].detach().clone())

    @contextmanager
    def active(self, lm: nn.Module):
        """Inside this context ``lm`` computes the reference policy (use it under no_grad)."""
        if self.lora:
            with lm.disable_adapter():
                yield
            return
        params = dict(lm.named_parameters())
        saved = []
        with torch.no_grad():
            for i, name in enumerate(self.names):
                saved.append(params[name].detach().clone())
                params[name].copy_(getattr(self, f"param_{i}"))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in zip(self.names, saved):
                    params[name].copy_(value)

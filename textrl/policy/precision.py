"""The autocast of a ``memory.precision`` value, for code that runs the policy outside the Trainer
(textrl-eval, textrl-play, textrl-attention): the same computation the policy was trained and
evaluated with, whose greedy choices are the ones its transcripts show."""

from __future__ import annotations

import contextlib

import torch

from textrl.config import native_bf16

AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def autocast_context(precision: str, device: str | torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``device`` for ``bf16-mixed`` / ``16-mixed`` (what Lightning's mixed
    precision wraps every forward in), no autocast for ``32-true``; ``auto`` is resolved as training
    resolves it: bf16-mixed where the device computes in bf16 natively, else 32-true."""
    device_type = torch.device(device).type
    if precision == "auto":
        precision = "bf16-mixed" if native_bf16(device_type == "cuda") else "32-true"
    if precision == "32-true":
        return contextlib.nullcontext()
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of ['32-true', 'bf16-mixed', '16-mixed', 'auto']")
    return torch.autocast(device_type, dtype=AUTOCAST_DTYPES[precision])

"""Linear layers computing on weights cast to the autocast dtype once, not at every call.

Under autocast every linear layer casts its fp32 weight to bf16 (or fp16) at every call: Lightning
turns autocast's own cache of those casts off (a cast made before an optimizer step would outlive
it), and autocast never caches a frozen weight. On a CPU with bf16 matrix units the casts, not the
products, then set the speed of the small calls a rollout and an update make: every weight read in
fp32 and written in bf16 per call.

``weights_cast_once(lm)`` is the context in which they are cast once instead:

* each layer's forward reads a copy of its weight (and bias) in the autocast dtype, cast at the
  layer's first call in the context -- a layer the context never runs (the frozen blocks an update
  replays, ``FrozenPrefix``) is never cast -- and cast again only once the parameter has changed
  (its version counter moved: an optimizer step, a checkpoint load, the KL reference swapped in);
* the parameters stay what they are (fp32: a trainable one is the optimizer's master weight). With
  gradients on, a trainable weight's copy enters the graph through ``_CastCopy``, whose backward
  hands the fp32 parameter the gradient in fp32, as autocast's cast does.

Autocast computes these layers in that dtype anyway, from the same rounded weights, so outputs and
gradients are bit for bit the same (``tests/test_cast_once.py``). The copies cost 2 bytes per
weight while the context lasts. Left out: the output embedding (tied to the input embedding's fp32
rows; the policy multiplies only a fork's few rows of it, ``PolicyValueModel.logits_of``), 4-bit and
other non-float weights, and every layer whose type is not exactly ``nn.Linear`` or GPT-2's
``Conv1D`` (a quantized or wrapped layer runs its own forward). Without autocast nothing changes.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn


class _CastCopy(torch.autograd.Function):
    """``copy`` (the parameter cast to a lower precision) in the graph of ``param``: the gradient
    reaching the copy goes to the parameter in the parameter's dtype."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = param.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


class _Casts:
    """The copies of the weights a context has cast, each with the parameter version it was cast from."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id -> (param, version, copy)

    def __call__(self, param: torch.Tensor | None) -> torch.Tensor | None:
        if param is None:
            return None
        entry = self.copies.get(id(param))
        if entry is None or entry[0] is not param or entry[1] != param._version:
            entry = (param, param._version, param.detach().to(self.dtype))
            self.copies[id(param)] = entry
        if torch.is_grad_enabled() and param.requires_grad:
            return _CastCopy.apply(param, entry[2])
        return entry[2]


def _linear_forward(casts: _Casts):
    def forward(self, x):
        return F.linear(x, casts(self.weight), casts(self.bias))
    return forward


def _conv1d_forward(casts: _Casts):
    def forward(self, x):  # transformers' Conv1D: a linear layer with its weight stored (in, out)
        out = torch.addmm(casts(self.bias), x.view(-1, x.size(-1)), casts(self.weight))
        return out.view(x.size()[:-1] + (self.nf,))
    return forward


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
        and module.weight.dim() == 2 and getattr(module, "bias", None) is not None


@contextlib.contextmanager
def weights_cast_once(lm: nn.Module, *extra: nn.Module):
    """Inside, under autocast on the weights' device, the linear layers of ``lm`` (its output
    embedding left out) and of ``extra`` (the value head) compute on weights cast to the autocast
    dtype once (the module docstring); outside, or without autocast, nothing changes.

    Inside, autocast's own weight-cast cache is off: it keeps one cast per weight for the whole
    autocast region, stale once an optimizer step moves the weight (Lightning 2.5 ran the whole
    ``training_step`` in one region with it on), and the copies here take its place."""
    first = next(lm.parameters(), None)
    device = first.device.type if first is not None else "cpu"
    if not torch.is_autocast_enabled(device):
        yield
        return
    dtype = torch.get_autocast_dtype(device)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    casts = _Casts(dtype)
    patched = []
    for module in (m for root in (lm, *extra) for m in root.modules()):
        conv1d = _is_conv1d(module)
        if module is head or not (type(module) is nn.Linear or conv1d) or "forward" in vars(module):
            continue  # the head, another kind of layer, or one an enclosing context already casts
        params = [p for _, p in module.named_parameters(recurse=False)]
        if not params or any(p.dtype not in (torch.float32, dtype) for p in params):
            continue
        module.forward = types.MethodType((_conv1d_forward if conv1d else _linear_forward)(casts), module)
        patched.append(module)
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cache)
        for module in patched:
            del module.forward

"""``memory.compile``: the trainable transformer blocks run through ``torch.compile`` in the update.

The update's forward and backward through the trainable blocks spend most of their time outside the
linear layers' products: attention's softmax and masks, RMSNorm, rotary embeddings, SwiGLU, residual
adds and autocast's casts, each a separate pass over memory (``bench/op_profile.py``). Inductor fuses
them. On the AMD EPYC of the benchmarks (bf16 autocast), compiling each trainable block whole made
the update's forward + backward of one sequence 0.81-0.86x as long; compiling only the MLP and norms
gained nothing, nor did any variant on a no-grad forward (``bench/compile_blocks.py``,
``bench/results/compile_blocks.json``). So:

* only the blocks with trainable parameters are compiled (the frozen ones either replay a recording
  in the update, ``textrl.policy.frozen_prefix``, or run without gradients);
* a block runs its compiled code only when gradients are on (the PPO epochs, the warm start); the
  rollout's KV-cache calls, the recompute of the old log-probs and evaluation run it eagerly, where
  compiling bought nothing and the cache's Python objects would be traced;
* attention stays eager inside the compiled block (``textrl.policy.model.sdpa_attention`` is
  excluded): its CPU products loop in Python over heads, query chunks and a stream's turns, which
  would be unrolled and specialised per sequence;
* shapes are dynamic from the start: the update's sequences have a new length at nearly every call.

The first update compiles (tens of seconds on a CPU, a few with inductor's on-disk cache warm), and
inductor needs a C++ compiler on a CPU (checked at start) and Triton on CUDA (shipped with CUDA
builds of torch). ``PolicyValueModel.last_mlp_at`` is off under it (its per-call hooks would
recompile the top block at every call)."""

from __future__ import annotations

import shutil

import torch
from torch import nn

# every trainable block shares one code object, whose compiled variants dynamo caches together
# (gradients with and without autocast, attention masks or none, ...); torch's default of 8 would
# leave the rest eager
RECOMPILE_LIMIT = 64


def check_compiler(device: torch.device | str) -> None:
    """Raise a clear error where inductor cannot build its CPU kernels: no C++ compiler on the PATH."""
    if torch.device(device).type != "cpu":
        return
    from torch._inductor import config as inductor_config  # slow import: only memory.compile needs it

    configured = inductor_config.cpp.cxx
    names = [n for n in (configured if isinstance(configured, (list, tuple)) else [configured]) if n]
    names = list(dict.fromkeys(names + ["g++", "clang++"]))
    if not any(shutil.which(n) for n in names):
        raise RuntimeError(f"memory.compile=true runs torch.compile, whose CPU kernels need a C++ compiler "
                           f"({' or '.join(names)} on the PATH); none was found. Install one (Debian/Ubuntu: "
                           f"apt install g++) or set memory.compile=false")


def compile_trainable_blocks(blocks: nn.ModuleList) -> list[int]:
    """Give each block of ``blocks`` with a trainable parameter a ``forward`` that runs compiled
    when gradients are on and eagerly otherwise; returns the compiled blocks' indices."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled = []
    for i, block in enumerate(blocks):
        if not any(p.requires_grad for p in block.parameters()):
            continue
        eager = block.forward
        fused = torch.compile(eager, dynamic=True)

        def forward(*args, _eager=eager, _fused=fused, **kwargs):
            return (_fused if torch.is_grad_enabled() else _eager)(*args, **kwargs)

        block.forward = forward  # an instance attribute: state_dict and hooks are the module's
        compiled.append(i)
    return compiled

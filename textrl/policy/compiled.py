"""``memory.compile``: each transformer block's parts other than attention run through ``torch.compile``.

Most of a CPU iteration's model time that is not matrix products is elementwise work in the blocks
(``bench/op_profile.py``): SwiGLU's SiLU and multiply, RMSNorm's square/mean/rsqrt/scale, residual
adds, autocast's casts, each a separate pass over memory, forward and backward. Inductor fuses each
chain into one kernel. ``bench/compile_blocks.py`` measures what that buys on the update's and a
forward's shapes; attention stays eager, since the CPU products path
(``textrl.policy.cpu_attention``) and the stream blocks (``textrl.policy.stream``) loop in Python over
heads and chunks, which compiling would unroll per sequence length.

What is compiled is the ``forward`` of every direct child of a block whose class is not an
attention (Llama/Qwen: ``mlp``, ``input_layernorm``, ``post_attention_layernorm``; GPT-2: ``ln_1``,
``ln_2``, ``mlp``), as an instance attribute: the module's hooks (``PolicyValueModel.last_mlp_at``'s
gather and scatter) stay outside the compiled code, and parameters and ``state_dict`` are untouched.
Shapes are dynamic from the start (``dynamic=True``): the rollout's packed calls and the update's
sequences have a new length nearly every call, and one kernel per length would recompile for ever.

Compiling costs seconds to tens of seconds in the first calls of each kind (rollout, update, with and
without gradients); inductor needs a C++ compiler on a CPU (checked at start), and Triton on CUDA
(shipped with CUDA builds of torch)."""

from __future__ import annotations

import shutil

import torch
from torch import nn


RECOMPILE_LIMIT = 64


def compiled_parts(blocks: nn.ModuleList) -> list[tuple[str, nn.Module]]:
    """(name, module) of the blocks' children that ``compile_blocks`` compiles."""
    parts = []
    for i, block in enumerate(blocks):
        for name, child in block.named_children():
            if "attention" not in type(child).__name__.lower():  # LlamaAttention, GPT2Attention, ...
                parts.append((f"{i}.{name}", child))
    return parts


def check_compiler(device: torch.device | str) -> None:
    """Raise a clear error where inductor cannot build its CPU kernels: no C++ compiler on the PATH."""
    if torch.device(device).type != "cpu":
        return
    from torch._inductor import config as inductor_config  # slow import: only memory.compile needs it

    names = inductor_config.cpp.cxx
    names = [n for n in (names if isinstance(names, (list, tuple)) else [names]) if n] or ["g++"]
    if not any(shutil.which(n) for n in names + ["g++", "clang++"]):
        raise RuntimeError(f"memory.compile=true runs torch.compile, whose CPU kernels need a C++ compiler "
                           f"({' or '.join(dict.fromkeys(names + ['g++', 'clang++']))} on the PATH); none was found. "
                           f"Install one (Debian/Ubuntu: apt install g++) or set memory.compile=false")


def compile_blocks(blocks: nn.ModuleList) -> int:
    """Compile the parts of ``blocks`` (``textrl.policy.model.transformer_blocks``) other than
    attention (module docstring); returns how many."""
    parts = compiled_parts(blocks)
    # every block's MLP shares one code object, whose compiled variants dynamo caches together: frozen
    # (bf16 in the rollout: PolicyValueModel.frozen_linears_in_autocast_dtype) and trainable weights,
    # with and without gradients, decoding steps of one token; torch's default of 8 would leave the
    # rest eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for _, module in parts:
        module.forward = torch.compile(module.forward, dynamic=True)
    return len(parts)

"""Memory of one batched rollout call's attention (the GPU layout of ``RaggedCache``), per layer:
the FlexAttention path that reads the cache in place against the padded gather it replaced.

    python bench/ragged_memory.py                       # 256 rows x 2,048 tokens, decode and prefill calls

For each model's attention shapes (heads, key/value heads, head dim; from the models' configs), a
call over ``--rows`` rows that each hold ``--tokens`` positions, feeding each ``width`` new tokens
(1: a fork's decode; 128: a turn's observation): the bytes of the tensors the layout creates for
one layer's attention, in bf16 (the cache's dtype under bf16 autocast).

- ``in_place``: built here by the code itself on the CPU (``row_block_mask``, the padded query
  index) and counted with ``nbytes``, plus the padded queries and the output ``[rows, heads,
  width, head dim]``; the block mask is built once per call and serves every layer. The compiled
  kernel's own workspace (its tiles) is not counted: it does not grow with the rows' lengths.
- ``padded_gather`` (textrl before this, ``git show 40fd3ed:textrl/policy/speed/ragged_cache.py``):
  the same queries and output, each row's keys and values gathered to the longest row, repeated per
  key/value group for CUDA's masked kernels, the boolean mask ``[rows, width, longest]`` and the
  gather's index; computed from the shapes.

No GPU is needed: these are sizes, not timings.
"""

from __future__ import annotations

import argparse

import torch

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.policy.speed.ragged_cache import RaggedCache

# (attention heads, key/value heads, head dim) of each model's config.json
MODELS = {"smollm2-135m": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64), "gpt2": (12, 12, 64)}
BF16 = 2


def in_place_index_bytes(rows: int, tokens: int, width: int) -> int:
    """The per-call tensors of the in-place layout, built by the code: a cache whose rows hold
    ``tokens - width`` positions, fed ``width`` more each."""
    cache = RaggedCache(rows, "cpu", batched=True)
    cache.lengths = [tokens - width] * rows
    call = cache.layout([width] * rows)  # every row outgrows its (empty) stretch: the layout's room
    ints = {k: torch.tensor(v) for k, v in call.parts.items()}
    cache.capacity = sum(call.room)
    state = cache._padded_layout(call, ints)
    mask = state["block_mask"]
    tensors = [state["q_index"], state["packed"], mask.kv_num_blocks, mask.kv_indices]
    return sum(t.nbytes for t in tensors)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--out", default="bench/results/ragged_memory.json")
    args = ap.parse_args(argv)
    r, n = args.rows, args.tokens
    calls = []
    for width in args.widths:
        index = in_place_index_bytes(r, n, width)
        for model, (heads, kv_heads, dim) in MODELS.items():
            queries_and_output = 2 * r * heads * width * dim * BF16
            gathered = 2 * r * kv_heads * n * dim * BF16  # keys and values to the longest row
            repeated = 2 * r * heads * n * dim * BF16 if heads > kv_heads else 0
            padded = queries_and_output + gathered + repeated + r * width * n + r * n * 8  # mask, kv index
            in_place = queries_and_output + index
            calls.append({"model": model, "width": width, "heads": heads, "kv_heads": kv_heads,
                          "in_place_mb": round(in_place / 2**20, 2), "padded_gather_mb": round(padded / 2**20, 1),
                          "ratio": round(padded / in_place, 1),
                          "block_mask_and_index_mb_per_call": round(index / 2**20, 2)})
    write_result(args.out, {"rows": r, "tokens": n, "dtype": "bfloat16", "per_layer_call": calls}, argv)


if __name__ == "__main__":
    main()

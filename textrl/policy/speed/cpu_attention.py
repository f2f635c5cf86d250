"""Attention on a CPU in bf16: torch's fused SDPA kernel, or two matrix products per key/value head,
whichever this machine runs faster (measured once, cached).

The rollout's calls feed a turn's prompt (a hundred or more new tokens) over a row's cached keys
(a thousand or more on medium games), and the update's stream blocks do the same. On the AMD EPYC
of the benchmarks (AVX512-BF16) the fused kernel runs those in bf16 no faster than in fp32, while
plain products -- the scores of the query heads that share a key/value head in one ``mm``, the
softmax, the probabilities times the values in another -- run a turn's prompt block, and a medium
iteration with it, faster (``bench/attention_kernels.py``, docs/results.md). Which is faster depends
on the CPU and torch (in fp32 the fused kernel wins there), so it is measured (``matmul_is_faster``),
never assumed; fp32, fp16 and GPUs always run SDPA.

The products round the scores to bf16 before the softmax, as transformers' eager attention does
under bf16; the fused kernel keeps them in fp32, so its output is nearer fp32's.
Queries go in chunks of ``QUERY_CHUNK`` rows, each over the keys it may see, so a long causal block
skips most of the masked half, as the fused kernel's own blocking does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time

import torch
from torch.nn import functional as F

from textrl.policy.speed.precision import cpu_model, precision_cache_dir

log = logging.getLogger(__name__)

QUERY_CHUNK = 128
# the shape the decision is measured on: SmolLM2-135M's heads, a turn's prompt over a medium row
MEASURE_SHAPE = {"heads": 9, "kv_heads": 3, "dim": 64, "queries": 128, "keys": 1024}
MEASURE_REPEATS = 5  # best of
MEASURE_METHOD = "bf16-prompt-block-v2"  # part of the cache key: a new method measures again


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
           mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
    """``query`` [1, heads, m, dim] over ``key``/``value`` [1, kv heads, n, dim] (heads a multiple
    of kv heads), causal from the bottom right: query i sees the first n - m + i + 1 keys, which
    ``mask`` ([m, n] bool) or ``is_causal`` (m = n) says to SDPA; a single query sees every key.
    Returns [1, heads, m, dim], as SDPA does. The products run on a CPU where the computation is
    bf16: the tensors' dtype, or bf16 autocast (under which the update's queries and keys arrive
    in fp32, rotated by fp32 cos/sin, and SDPA would cast them)."""
    if (mask is not None or is_causal or query.shape[2] == 1) and products_run(query):
        return matmul_attention(*(t.to(torch.bfloat16) for t in (query, key, value)), scale)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=query.shape[1] != key.shape[1])


def products_run(query: torch.Tensor) -> bool:
    """Whether attention over ``query`` runs the products: on a CPU, in bf16 (the dtype, or bf16
    autocast), where this machine measured them faster."""
    return query.device.type == "cpu" and (query.dtype == torch.bfloat16 or (
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16)) and matmul_is_faster()


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                     chunk: int = QUERY_CHUNK) -> torch.Tensor:
    """``attend``'s products (module docstring), bottom-right causal, for any dtype; differentiable."""
    _, heads, m, dim = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = dim ** -0.5 if scale is None else scale
    out = []
    for c0 in range(0, m, chunk):
        c1 = min(m, c0 + chunk)
        size, seen = c1 - c0, n - m + c1  # the chunk's last query sees keys :seen; all of them before n - m + c0
        # the chunk's own square is causal: the keys after each query's own are hidden
        hidden = torch.ones(size, size, dtype=torch.bool, device=query.device).triu(1) if size > 1 else None
        per_head = []
        for h in range(kv_heads):
            q = query[0, h * groups: (h + 1) * groups, c0:c1].reshape(groups * size, dim) * scale
            scores = torch.mm(q, key[0, h, :seen].t()).view(groups, size, seen)
            if hidden is not None:
                scores[:, :, seen - size:].masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores.view(groups * size, seen), dim=-1)  # sums in fp32
            per_head.append(torch.mm(probs, value[0, h, :seen]).view(groups, size, dim))
        out.append(torch.cat(per_head))
    return torch.cat(out, dim=1)[None]


def _measure() -> tuple[float, float]:
    """(fused kernel, products) seconds of one prompt block in bf16 (``MEASURE_SHAPE``), best of
    ``MEASURE_REPEATS`` after a warm-up; a generator of its own leaves the run's random state alone."""
    s = MEASURE_SHAPE
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, s["heads"], s["queries"], s["dim"], generator=gen).bfloat16()
    k, v = (torch.randn(1, s["kv_heads"], s["keys"], s["dim"], generator=gen).bfloat16() for _ in range(2))
    mask = torch.ones(s["queries"], s["keys"], dtype=torch.bool).tril(s["keys"] - s["queries"])
    best = [float("inf"), float("inf")]
    kernels = (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
               lambda: matmul_attention(q, k, v, None))
    with torch.no_grad():
        for repeat in range(MEASURE_REPEATS + 1):
            for i, run in enumerate(kernels):
                start = time.perf_counter()
                run()
                if repeat:
                    best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def _cache_key() -> dict:
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "method": MEASURE_METHOD, "shape": MEASURE_SHAPE}


@functools.cache
def matmul_is_faster() -> bool:
    """Whether the products beat the fused kernel in bf16 on this machine: read from
    ``<textrl cache>/precision/attention-<key>.json`` (CPU model, torch threads, torch version,
    method), else measured (a few milliseconds) and kept there. Once per process."""
    key = _cache_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = precision_cache_dir() / f"attention-{digest}.json"
    try:
        data = json.loads(path.read_text())
        if data["key"] == key:
            faster = bool(data["matmul_is_faster"])
            log.info("bf16 attention on this CPU: %s (measured before: the fused SDPA kernel %.2f ms, matrix products "
                     "%.2f ms; read from %s)", "matrix products" if faster else "the fused kernel",
                     float(data["fused_ms"]), float(data["matmul_ms"]), path)
            return faster
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s: unreadable attention decision (%s): measuring again", path, exc)
    fused, products = _measure()
    faster = products < fused
    log.info("bf16 attention on this CPU: %s (measured: the fused SDPA kernel %.2f ms, matrix products %.2f ms "
             "a %d x %d block; cached in %s)", "matrix products" if faster else "the fused kernel", fused * 1e3,
             products * 1e3, MEASURE_SHAPE["queries"], MEASURE_SHAPE["keys"], path)
    data = {"matmul_is_faster": faster, "fused_ms": round(fused * 1e3, 4), "matmul_ms": round(products * 1e3, 4),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "key": key}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not cache the attention decision in %s (%s): it is measured again next time", path, exc)
    return faster

"""The machine's matrix-multiply peak in fp32 and bf16: what a model's achieved FLOP/s is a share of.

    python bench/peak.py                          # the default model's shapes, at the runs' torch threads
    python bench/peak.py threads=2                # Hydra overrides of train.py (threads, model)
    python bench/peak.py --sizes 64 --rows 8 --repeats 1 --out /tmp/peak.json    # a smoke run (seconds)

On a CPU without native bf16 (AVX2 only, where bf16 is emulated at about a tenth of fp32's rate) the
default sizes take more than 15 minutes, most of it the 4096 squares in bf16: ``--sizes 1024`` is
about a minute.

At the torch thread count a run of ``python train.py <overrides>`` uses (its ``threads`` setting, else
torch's default), every product below is timed ``--repeats`` times after one warm-up call (a timed
round repeats a small product until it lasts 20 ms), and its best round kept:

* square matmuls, ``torch.mm`` of two n x n matrices for each of ``--sizes``: 2 n^3 FLOPs;
* ``F.linear`` of the model's own layer shapes on ``--rows`` tokens: 2 x rows x in x out FLOPs. The
  shapes are the model config's (attention q and o, k and v, the MLP's up/gate and down, the output
  head), read through textrl's loader where that is cheap (a random architecture, a GGUF model
  already converted, a hub model in the local cache; never a conversion); else SmolLM2-135M's,
  listed here (``shapes_from`` says which);

each in three modes: ``fp32`` tensors, native ``bf16`` tensors, and fp32 tensors under
``torch.autocast("cpu", torch.bfloat16)`` (``bf16_autocast``: what ``memory.precision=bf16-mixed``
runs, its casts in the time).

**The peak of a precision is the best rate of all of its measured shapes**: fp32's over the fp32
mode, bf16's over the native and autocast modes together -- the most the machine reached, not one
shape's rate (``peak_shape`` names the product that reached it). Writes ``bench/results/peak.json``;
``bench/iteration.py`` measures the same (``measure``) in its own process and reports each phase's
achieved model FLOP/s as a share of the peak of the precision the run uses.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import platform
import time

import torch
import torch.nn.functional as F

from compose import train_config  # bench/compose.py
from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import native_bf16

SIZES = (1024, 2048, 4096)
ROWS = (128, 1024)  # a fork level's packed call feeds tens of tokens, a prompt or an update's sequence hundreds
# SmolLM2-135M (the default model), for when its config is not at hand
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "vocab_size": 49152}
# mode -> (tensor dtype, under bf16 autocast, the precision whose peak it counts towards)
MODES = {"fp32": (torch.float32, False, "fp32"), "bf16": (torch.bfloat16, False, "bf16"),
         "bf16_autocast": (torch.float32, True, "bf16")}


def precision_of(lightning_precision: str) -> str | None:
    """The peak a run's ``memory.precision`` computes at: fp32, bf16, or None (16-mixed: not measured)."""
    if lightning_precision.startswith("bf16"):
        return "bf16"
    return "fp32" if lightning_precision.startswith("32") else None


def model_config(model_cfg, cache_dir=None):
    """(the model's Hugging Face config, where it was read) through textrl's loader when that is
    cheap -- a random architecture, a GGUF model already converted, a hub model in the local
    cache -- else (None, why not). Never converts a GGUF file (~30 s) or reaches the hub."""
    from transformers import AutoConfig  # slow import

    from textrl.config import load_model_config
    from textrl.policy.model import model_cache_dir

    try:
        if model_cfg.source == "random" and model_cfg.architecture:
            arch = dict(model_cfg.architecture)
            if "vocab_size" not in arch and model_cfg.tokenizer_from:  # textrl takes its tokenizer's
                vocab, _ = model_config(load_model_config(model_cfg.tokenizer_from), cache_dir)
                if vocab is not None:
                    arch["vocab_size"] = vocab.vocab_size
            return AutoConfig.for_model(arch.pop("model_type"), **arch), f"model.architecture of {model_cfg.name}"
        gguf = model_cfg.source == "gguf" or (model_cfg.source == "random" and model_cfg.gguf_file)
        location = str(model_cache_dir(cache_dir) / model_cfg.name) if gguf else (model_cfg.path or model_cfg.hub_id)
        return AutoConfig.from_pretrained(location, local_files_only=True), location
    except Exception as exc:  # not converted yet, not in the cache: the listed shapes
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def linear_shapes(config) -> dict[str, tuple[int, int]]:
    """(in, out) features of the model's linear layers by role, from a Hugging Face config (or a dict
    of its keys); roles of the same shape are one entry ("attention_q/attention_o")."""
    def get(key, default=None):
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        return default if value is None else value

    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim", hidden // heads)
    inner = get("intermediate_size", get("n_inner", 4 * hidden))  # GPT-2: n_inner, None for 4 x hidden
    roles = {"attention_q": (hidden, heads * head_dim), "attention_o": (heads * head_dim, hidden),
             "attention_k/attention_v": (hidden, get("num_key_value_heads", heads) * head_dim),
             "mlp_up/mlp_gate": (hidden, inner), "mlp_down": (inner, hidden), "head": (hidden, get("vocab_size"))}
    by_shape: dict[tuple[int, int], list[str]] = {}
    for role, shape in roles.items():
        by_shape.setdefault(shape, []).append(role)
    return {"/".join(names): shape for shape, names in by_shape.items()}


def best_rate(fn, flops: float, repeats: int, min_s: float = 0.02) -> float:
    """The best FLOP/s of ``fn`` over ``repeats`` timed rounds, after one warm-up call; a round calls
    ``fn`` as many times as make it last about ``min_s`` (small products outlast the clock's grain)."""
    start = time.perf_counter()
    fn()
    calls = max(1, math.ceil(min_s / max(time.perf_counter() - start, 1e-9)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return flops / best


def measure(shapes: dict[str, tuple[int, int]], sizes=SIZES, rows=ROWS, repeats: int = 5) -> dict:
    """GFLOP/s of every product in every mode (module docstring), and each precision's peak: the
    best of its shapes."""
    gen = torch.Generator().manual_seed(0)
    gflops: dict[str, dict[str, float]] = {}
    for mode, (dtype, autocast, _) in MODES.items():
        rates = gflops[mode] = {}

        def timed(name, op, flops):
            def fn():
                with torch.autocast("cpu", torch.bfloat16) if autocast else contextlib.nullcontext():
                    op()
            rates[name] = round(best_rate(fn, flops, repeats) / 1e9, 1)

        with torch.no_grad():
            for n in sizes:
                a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
                timed(f"mm_{n}", lambda: torch.mm(a, b), 2 * n ** 3)
            for role, (fan_in, fan_out) in shapes.items():
                w = torch.randn(fan_out, fan_in, generator=gen).to(dtype)
                for m in rows:
                    x = torch.randn(m, fan_in, generator=gen).to(dtype)
                    timed(f"linear_{role}_{m}x{fan_in}->{fan_out}", lambda: F.linear(x, w), 2 * m * fan_in * fan_out)
    peak, shape = {}, {}
    for precision in ("fp32", "bf16"):
        best = max(((rate, f"{mode} {name}") for mode, (_, _, p) in MODES.items() if p == precision
                    for name, rate in gflops[mode].items()), default=(None, None))
        peak[precision], shape[precision] = best
    return {"peak_gflops": peak, "peak_shape": shape, "gflops": gflops,
            "shapes": {k: list(v) for k, v in shapes.items()}, "sizes": list(sizes), "rows": list(rows),
            "repeats": repeats, "torch_threads": torch.get_num_threads()}


def model_shapes(cfg) -> tuple[dict[str, tuple[int, int]], str]:
    """The linear shapes of the run's model, and where they were read (``shapes_from``)."""
    config, where = model_config(cfg.model, cfg.cache_dir)
    if config is None:
        return linear_shapes(SMOLLM2), f"listed (SmolLM2-135M): the model's config was not at hand ({where})"
    return linear_shapes(config), where


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="square matmul sizes")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help="tokens of the model-shaped linears")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds of each product (best kept)")
    ap.add_argument("--out", default="bench/results/peak.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of train.py (its threads and model)")
    args = ap.parse_args(argv)

    cfg = train_config(args.overrides)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    shapes, where = model_shapes(cfg)
    out = {**measure(shapes, args.sizes, args.rows, args.repeats),
           "peak_is": "the best GFLOP/s of all measured shapes of the precision (bf16: native and autocast)",
           "model": cfg.model.name, "shapes_from": where,
           "run_precision": cfg.memory.precision, "run_peak": precision_of(cfg.memory.precision),
           "cpu_native_bf16": native_bf16(False), "torch": torch.__version__,
           "machine": platform.processor() or platform.machine()}
    write_result(args.out, out, argv, show={k: out[k] for k in ("peak_gflops", "peak_shape", "torch_threads",
                                                                 "shapes_from", "run_precision")})


if __name__ == "__main__":
    main()

"""One AdamW step over the default run's trainable parameters, in each of torch's implementations.

    python bench/optimizer.py                        # SmolLM2-135M, top 6 blocks + value head (the default)
    python bench/optimizer.py model=qwen             # any Hydra overrides of train.py

torch's AdamW on CPU tensors defaults to its single-tensor implementation (a Python loop of small ops
per parameter); ``textrl.policy.memory.make_optimizer`` asks for the fused one. This times a step of
each (``--steps`` steps per round, ``--rounds`` rounds alternating the implementations, same process)
on random gradients of the real parameters, and checks that make_optimizer's choice is the fused one.
A default iteration makes one step per 4 training sequences per PPO epoch (``perf/update_s`` holds them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from compose import train_config  # bench/compose.py
from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import native_bf16
from textrl.policy.memory import make_optimizer
from textrl.policy.model import build_policy

IMPLEMENTATIONS = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps timed per round")
    ap.add_argument("--out", default="bench/results/optimizer.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    cfg = train_config(args.overrides)
    if cfg.memory.optimizer != "adamw":
        raise SystemExit(f"memory.optimizer={cfg.memory.optimizer}: this compares torch's AdamW implementations only")
    policy, _ = build_policy(cfg.model, cfg.env.step_penalty, cfg.cache_dir, cfg.memory)
    p = cfg.ppo
    lm = [q for q in policy.lm.parameters() if q.requires_grad]
    value = list(policy.value_head.parameters())
    generator = torch.Generator().manual_seed(0)
    for q in lm + value:
        q.grad = torch.randn(q.shape, generator=generator) * 1e-3

    def groups():
        return [{"params": lm, "lr": p.lr_lm}, {"params": value, "lr": p.lr_value}]

    optimizers = {name: torch.optim.AdamW(groups(), weight_decay=p.weight_decay, **kw) for name, kw in IMPLEMENTATIONS.items()}
    chosen = make_optimizer(lm, value, cfg.memory, p.lr_lm, p.lr_value, p.weight_decay)
    seconds: dict[str, list[float]] = {name: [] for name in optimizers}
    with torch.no_grad():
        for optimizer in optimizers.values():
            optimizer.step()  # allocates the moments outside the clock
        for _ in range(args.rounds):
            for name, optimizer in optimizers.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    optimizer.step()
                seconds[name].append((time.perf_counter() - start) / args.steps)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    out = {
        "model": cfg.model.name, "trainable_layers": cfg.model.trainable_layers,
        "trainable_parameters": sum(q.numel() for q in lm + value), "tensors": len(lm + value),
        "step_ms_median": {k: round(v * 1000, 1) for k, v in median.items()},
        "step_ms_range": {k: [round(min(v) * 1000, 1), round(max(v) * 1000, 1)] for k, v in seconds.items()},
        "for_loop_over_fused": round(median["for_loop"] / median["fused"], 2),
        "make_optimizer_fused": bool(chosen.defaults.get("fused")),
        "rounds": args.rounds, "steps_per_round": args.steps,
        # optimizer states and steps are fp32 whatever memory.precision is
        "cpu_native_bf16": native_bf16(False), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
    }
    write_result(args.out, out, argv)


if __name__ == "__main__":
    main()

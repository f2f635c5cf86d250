"""Checkpoint size and write time of the default run, everything saved vs what training changes.

    python bench/checkpoint.py                       # SmolLM2-135M, top 6 blocks (the default)
    python bench/checkpoint.py model=qwen            # any Hydra overrides of train.py

Builds the policy and the PPOModule of the composed config, gives every trainable parameter its
AdamW state (one optimizer step on zero gradients), then writes the checkpoint Lightning would
write (state_dict, optimizer state, textrl's entries) through textrl's atomic checkpoint writer,
``--rounds`` times each way, alternating: with the frozen weights (what textrl wrote before) and
without them (``PPOModule.on_save_checkpoint`` today). Same process, same machine, same disk.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from compose import train_config  # bench/compose.py
from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.policy.memory import make_optimizer
from textrl.policy.model import build_policy
from textrl.training.callbacks import AtomicCheckpointIO
from textrl.training.module import PPOModule


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/checkpoint.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    cfg = train_config(args.overrides)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty, cfg.cache_dir, cfg.memory)
    module = PPOModule(cfg, policy, tokenizer)
    p = cfg.ppo
    optimizer = make_optimizer([q for q in policy.lm.parameters() if q.requires_grad],
                               list(policy.value_head.parameters()), cfg.memory, p.lr_lm, p.lr_value, p.weight_decay)
    for q in policy.parameters():
        if q.requires_grad:
            q.grad = q.detach().new_zeros(q.shape)
    optimizer.step()  # allocates AdamW's two moments per trainable parameter, as after a real step

    def checkpoint(slim: bool) -> dict:
        saved_keys = module.frozen_keys
        module.frozen_keys = saved_keys if slim else set()
        ckpt = {"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()], "epoch": 0}
        module.on_save_checkpoint(ckpt)
        module.frozen_keys = saved_keys
        return ckpt

    io = AtomicCheckpointIO()
    seconds: dict[str, list[float]] = {"full": [], "slim": []}
    size = {}
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:  # the disk runs write their checkpoints to
        for _ in range(args.rounds):
            for name in ("full", "slim"):
                path = Path(tmp) / f"{name}.ckpt"
                ckpt = checkpoint(name == "slim")
                start = time.perf_counter()
                io.save_checkpoint(ckpt, path)
                seconds[name].append(time.perf_counter() - start)
                size[name] = path.stat().st_size
                path.unlink()
    trainable = sum(q.numel() for q in policy.parameters() if q.requires_grad)
    out = {
        "model": cfg.model.name, "trainable_layers": cfg.model.trainable_layers, "lora": cfg.memory.lora,
        "parameters": sum(q.numel() for q in policy.parameters()), "trainable_parameters": trainable,
        "size_mb": {k: round(v / 2**20, 1) for k, v in size.items()},
        "size_ratio_slim_to_full": round(size["slim"] / size["full"], 3),
        "write_s_median": {k: round(statistics.median(v), 3) for k, v in seconds.items()},
        "write_s_range": {k: [round(min(v), 3), round(max(v), 3)] for k, v in seconds.items()},
        "rounds": args.rounds,
        "target": {"size_ratio_slim_to_full": 0.4},
    }
    write_result(args.out, out, argv)


if __name__ == "__main__":
    main()

"""Long runs do not grow: resident memory per PPO iteration over a long run of the tiny model.

Each setting (``--envs``, default the easy TextWorld games and the TextWorldExpress coin game) trains
``model=tiny`` for ``--iterations`` iterations (default 100) with the games held by
``env.step_workers=2`` worker processes (TextWorldExpress: each worker runs its own JVM engine),
and records after every iteration the resident memory (RSS) of the training process and of all its
descendants (workers, JVMs). Growth is the last ``--window`` iterations' mean over the mean of the
``--window`` iterations after ``--warmup``: a leak shows as growth that keeps going, while caches
filling up in the first iterations do not count. Writes ``bench/results/soak.json``.

    python bench/soak.py                                  # 100 iterations each of easy and twx_coin
    python bench/soak.py --iterations 20 --envs easy      # a quick look
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import psutil
import torch

from compose import train_config  # bench/compose.py
from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.cli.train import train

SMALL = ["model=tiny", "env.num_envs=8", "env.pool_size=64", "env.step_workers=2", "eval.games=4",
         "eval.batch=4", "eval.train_games=0", "eval.before_training=false", "eval.transcripts=0", "memory=none",
         "warm_start.steps=0", "ppo.kl_coef=0"]  # RL alone, the iterations soak.json measured


def resident_mb() -> dict[str, float]:
    """RSS of this process and of its descendants (game workers, JVMs), in MiB."""
    me = psutil.Process(os.getpid())
    children = me.children(recursive=True)
    rss = [p.memory_info().rss for p in children if p.is_running()]
    return {"main_mb": me.memory_info().rss / 2**20, "children_mb": sum(rss) / 2**20, "children": len(rss)}


class Memory(L.Callback):
    def __init__(self):
        self.rows: list[dict] = []
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        row = resident_mb()
        row.update(iteration=trainer.current_epoch + 1, seconds=round(time.perf_counter() - self.start, 1))
        row["total_mb"] = row["main_mb"] + row["children_mb"]
        self.rows.append(row)


def growth(rows: list[dict], key: str, warmup: int, window: int) -> float:
    """Relative growth of ``key``: mean of the last ``window`` rows over the ``window`` after ``warmup``."""
    early = [r[key] for r in rows[warmup: warmup + window]]
    late = [r[key] for r in rows[-window:]]
    return statistics.fmean(late) / statistics.fmean(early) - 1 if early and late else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--envs", nargs="+", default=["easy", "twx_coin"])
    ap.add_argument("--warmup", type=int, default=10, help="iterations left out before the first window")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--out", default="bench/results/soak.json")
    args = ap.parse_args(argv)
    results = {}
    for env in args.envs:
        run_dir = Path(tempfile.mkdtemp(prefix=f"textrl_soak_{env}_"))
        overrides = [f"env={env}", *SMALL, f"iterations={args.iterations}", f"eval.every={args.iterations}"]
        memory = Memory()
        cfg = train_config(overrides, str(run_dir))
        train(cfg, callbacks=[memory])
        rows = memory.rows
        results[env] = {
            "overrides": overrides, "precision": cfg.memory.precision,
            "growth_main": growth(rows, "main_mb", args.warmup, args.window),
            "growth_total": growth(rows, "total_mb", args.warmup, args.window),
            "iterations": rows,
        }
        print(env, {k: v for k, v in results[env].items() if k.startswith("growth")}, flush=True)
    out = {"results": results, "warmup": args.warmup, "window": args.window,
           "max_growth_total": max(r["growth_total"] for r in results.values()),
           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine()}
    write_result(args.out, out, argv, show={"max_growth_total": out["max_growth_total"],
                                            **{e: {k: v for k, v in r.items() if k.startswith("growth")}
                                               for e, r in results.items()}})


if __name__ == "__main__":
    main()

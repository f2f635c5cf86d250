"""Learning benchmark: train with a config (the default one unless overridden) and record how the
held-out evaluation changed.

    python bench/learn.py                                  # the default CPU configuration
    python bench/learn.py --out bench/results/x.json -- env=medium iterations=10

Writes eval win rate / episode length at the start (iteration 0, untrained) and the end, the wall
minutes of training (the one-off set-up, generating the game pool and converting the model, is
done before the clock starts), iterations, the mean per-iteration timings (rollout, recompute, update, evaluation), the
resolved precision, whether the CPU computes bf16 natively, the torch version, the exact command
and the composed config.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import time
from pathlib import Path

import torch

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import textrl.cli.train as cli
from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import CONF_DIR, native_bf16, to_train_config
from textrl.policy.model import load_tokenizer
from textrl.training.datamodule import RolloutDataModule


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/learn_cpu.json")
    ap.add_argument("--run-dir", default="outputs/bench_learn")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    args = ap.parse_args(argv)

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"output_dir={args.run_dir}", *args.overrides])
    prepared = to_train_config(cfg)
    RolloutDataModule(prepared).prepare_data()  # generate (or find) the games
    load_tokenizer(prepared.model, prepared.cache_dir)  # convert (or find) the model
    start = time.perf_counter()
    result = cli.train(cfg)
    minutes = (time.perf_counter() - start) / 60

    with open(Path(result["run_dir"]) / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evals = [r for r in rows if r.get("eval/win_rate")]
    first, last = evals[0], evals[-1]

    def mean(key):
        values = [float(r[key]) for r in rows if r.get(key)]
        return round(statistics.fmean(values), 3) if values else None

    resolved = result["module"].cfg
    out = {
        "eval_win_rate_start": float(first["eval/win_rate"]),
        "eval_win_rate_end": float(last["eval/win_rate"]),
        "eval_episode_len_start": float(first["eval/episode_len"]),
        "eval_episode_len_end": float(last["eval/episode_len"]),
        "eval_curve": [[int(float(r["iteration"])), float(r["eval/win_rate"]), float(r["eval/episode_len"])]
                       for r in evals],
        "minutes": round(minutes, 1),
        "iterations": int(float(last["iteration"])),
        "eval_games": cfg.eval.games,
        "seconds_per_iteration": {"rollout": mean("perf/rollout_s"), "recompute_old": mean("perf/recompute_s"),
                                  "update": mean("perf/update_s"), "evaluation": mean("perf/eval_s")},
        "rollout_logratio_max_mean": mean("policy/rollout_logratio_max"),
        "first_logratio_max_mean": mean("policy/first_logratio_max"),
        "precision": resolved.memory.precision,
        "recompute_old": resolved.ppo.recompute_old,
        "cpu_native_bf16": native_bf16(False),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "targets": {"eval_win_rate_end": 0.9, "eval_episode_len_end": 1.5, "minutes": 30},
        "config": OmegaConf.to_container(cfg, resolve=False),
    }
    write_result(args.out, out, argv, show={k: v for k, v in out.items() if k != "config"})


if __name__ == "__main__":
    main()

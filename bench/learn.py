"""Learning benchmark and ablations: named configurations x seeds, each a real ``python train.py``
run, summarised as held-out win rate and steps (mean ± std over seeds), minutes and the commands.

    python bench/learn.py                                      # the default config, seeds 1 2 3
    python bench/learn.py --configs default grpo explore --seeds 1 2 3
    python bench/learn.py --configs default --seeds 1 --tag medium -- experiment=medium_cpu

Each configuration writes ``bench/results/learn_<tag>_<config>.json`` after every seed (a partial
file is still a result: it lists the seeds it has); a later invocation with other seeds and the same
overrides adds its seeds to the file (each run keeps its command, commit, threads and minutes). A run is ``python train.py <config overrides>
<extra overrides> seed=S hydra.run.dir=<runs>/<tag>/<config>/seed<S>`` in a subprocess, exactly what
a user types, so ``textrl-report <runs>/<tag>`` groups the runs by configuration (Hydra's
overrides) and plots their curves with bands. Games and the converted model are prepared before
the clock starts; ``minutes`` is the subprocess's wall time (model loading included).

Each file records the resolved precision, whether the CPU computes bf16 natively, the torch version
and the machine: compare minutes only between files measured on the same machine.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from omegaconf import OmegaConf

from compose import composed, train_config  # bench/compose.py
from result import command, write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import native_bf16
from textrl.policy.model import load_tokenizer
from textrl.training.datamodule import RolloutDataModule

ROOT = Path(__file__).resolve().parent.parent

# The levers of issue 12, each alone on top of the default (python train.py). The default has had
# env.goal_last=true since the easy ablation chose it; the easy12 files were measured before, when
# it was false (each run records its commit: check that commit out to reproduce one), and there
# "goal_last" was the lever and "default" the objective in the system message only.
CONFIGS = {
    "default": [],
    "goal_first": ["env.goal_last=false"],  # the objective in the system message only (the seed's prompt)
    "grpo": ["env.group_size=4", "ppo.advantage=grpo"],  # 4 games x 4 samples, no value head
    "rloo": ["env.group_size=4", "ppo.advantage=rloo"],
    "kl": ["ppo.kl_coef=0.05"],  # KL anchor to the initial policy
    "explore": ["ppo.explore=0.1"],  # 10 % uniform over each fork's children
    "warm_start": ["warm_start.steps=16"],  # behaviour cloning: 2 passes over 64 training walkthroughs first
    "list_commands": ["env.list_commands=true"],  # admissible commands shown in the prompt
    "lora_all": ["memory=lora"],  # LoRA adapters on all 30 blocks instead of the top 6 blocks
}


def summarize_run(run_dir: Path) -> dict:
    with open(run_dir / "logs" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    evals = [r for r in rows if r.get("eval/win_rate")]

    def mean(key):
        values = [float(r[key]) for r in rows if r.get(key)]
        return round(statistics.fmean(values), 3) if values else None

    last = evals[-1]
    out = {
        "eval_win_rate": float(last["eval/win_rate"]), "eval_episode_len": float(last["eval/episode_len"]),
        "eval_train_win_rate": float(last["eval/train_win_rate"]) if last.get("eval/train_win_rate") else None,
        "eval_curve": [[int(float(r["iteration"])), float(r["eval/win_rate"]), float(r["eval/episode_len"])]
                       for r in evals],
        "rollout_win_rate_first_iterations": [float(r["rollout/win_rate"]) for r in rows if r.get("rollout/win_rate")][:3],
        # the training rollouts' (sampled) win rate and episode length at every iteration: the curve
        # between evaluations, which a run evaluated rarely (medium_cpu) has no other way to show
        "rollout_curve": [[int(float(r["iteration"])), float(r["rollout/win_rate"]), float(r["rollout/episode_len"])]
                          for r in rows if r.get("rollout/win_rate")],
        "iterations": int(float(last["iteration"])),
        "seconds_per_iteration": {"rollout": mean("perf/rollout_s"), "recompute_old": mean("perf/recompute_s"),
                                  "reference": mean("perf/reference_s"), "update": mean("perf/update_s"),
                                  "evaluation": mean("perf/eval_s")},
    }
    # the run's own torch threads (threads=1 when two screening runs share a 2-core machine): minutes
    # compare only between runs with the same threads on the same machine
    resolved = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    out["threads"] = resolved.get("threads") or torch.get_num_threads()
    warm = run_dir / "warm_start.json"
    if warm.is_file():
        out["warm_start"] = json.loads(warm.read_text())
    return out


# a default that changed without a config value changing: since commit 0c0c08f,
# curriculum.replay (0.25) replays lost games without curriculum stages too (before: with stages only).
# Stored with each run's resolved config: earlier runs lack the key, so they do not pool with later ones
BEHAVIOUR = {"curriculum_replay_without_stages": True}
# keys of a run's resolved config that do not change what it learns: seeds of one configuration
# differ in them and still pool
UNPOOLED = {"seed", "threads", "output_dir", "cache_dir", "ckpt_path"}


def differing_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    keys = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            keys += differing_keys(x, y, f"{prefix}{k}.")
        elif x != y:
            keys.append(f"{prefix}{k}")
    return keys


def earlier_runs(out_path: Path, overrides: list[str], seeds: set[int],
                 resolved: dict) -> tuple[list[dict], list[str]]:
    """The runs of other seeds a result file already holds, and the commands that added them, if the
    file is of the same configuration and overrides (a file of another configuration is replaced).
    Same overrides at another commit can still mean another config (a default changed since): runs
    that recorded their resolved config pool only with runs of the same one."""
    previous = json.loads(out_path.read_text()) if out_path.is_file() else None
    if not previous or previous["overrides"] != overrides:
        return [], []
    runs = [r for r in previous["runs"] if r["seed"] not in seeds]
    for r in runs:
        differ = differing_keys(r["resolved"], resolved) if "resolved" in r else []
        if differ:
            raise SystemExit(
                f"{out_path} holds seed {r['seed']} (commit {r['commit']}) of the same overrides but another "
                f"resolved config ({', '.join(differ)} differ): a default "
                f"changed since. Its seeds would not be one configuration: pass another --tag, or check out "
                f"that commit to add seeds to it.")
    for r in runs:  # files written before runs recorded their threads: the file's one figure
        r.setdefault("threads", previous["torch_threads"])
    return runs, previous.get("commands", [previous["command"]]) if runs else []


def mean_std(values: list[float]) -> dict:
    return {"mean": round(statistics.fmean(values), 4),
            "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0, "values": values}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["default"], choices=sorted(CONFIGS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--tag", default="easy", help="names the result files and the runs' folder")
    ap.add_argument("--runs", default="outputs/bench_learn", help="where the runs go")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides added to every configuration")
    args = ap.parse_args(argv)

    resolved = train_config(args.overrides)
    RolloutDataModule(resolved).prepare_data()  # generate (or find) the games before any clock starts
    load_tokenizer(resolved.model, resolved.cache_dir)  # convert (or find) the model

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    for name in args.configs:
        out_path = ROOT / "bench" / "results" / f"learn_{args.tag}_{name}.json"
        # threads=N changes how fast a run goes, not what it learns: not part of what the file holds
        overrides_all = [o for o in (*CONFIGS[name], *args.overrides) if not o.startswith("threads=")]
        config = OmegaConf.to_container(composed([*CONFIGS[name], *args.overrides]))
        config = {k: v for k, v in config.items() if k not in UNPOOLED}
        config.update(BEHAVIOUR)
        earlier_runs(out_path, overrides_all, set(args.seeds), config)  # refuses now, not after the runs
        mine = []
        for seed in args.seeds:
            run_dir = (ROOT / args.runs / args.tag / name / f"seed{seed}").resolve()
            overrides = [*CONFIGS[name], *args.overrides, f"seed={seed}"]
            cmd = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
            if run_dir.exists():  # a seed run again replaces its run (its logs would otherwise mix in)
                shutil.rmtree(run_dir)
            run_dir.mkdir(parents=True)
            start = time.perf_counter()
            with open(run_dir / "train.log", "w") as log:
                subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
            minutes = (time.perf_counter() - start) / 60
            mine.append({"seed": seed, "minutes": round(minutes, 1), "command": "python train.py " + " ".join(overrides),
                         "commit": commit, "resolved": config,
                         "run_dir": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
                         **summarize_run(run_dir)})
            # the file is read again now, not before the runs: another invocation adding other seeds
            # to the same file meanwhile (two queues side by side) keeps its runs
            others, commands = earlier_runs(out_path, overrides_all, {r["seed"] for r in mine}, config)
            runs = sorted([*others, *mine], key=lambda r: r["seed"])
            result = {
                "config": name, "overrides": overrides_all,
                "seeds": [r["seed"] for r in runs],
                "eval_win_rate": mean_std([r["eval_win_rate"] for r in runs]),
                "eval_episode_len": mean_std([r["eval_episode_len"] for r in runs]),
                "minutes": mean_std([r["minutes"] for r in runs]),
                "eval_games": resolved.eval.games, "runs": runs,
                "precision": resolved.memory.precision, "cpu_native_bf16": native_bf16(False),
                "torch": torch.__version__, "torch_threads": sorted({r["threads"] for r in runs}),
                "machine": platform.processor() or platform.machine(),
                # every invocation that added seeds to this file (this one once, though it writes after each seed)
                "commands": list(dict.fromkeys([*commands, command(argv)])),
            }
            write_result(str(out_path), result, argv,
                         show={k: result[k] for k in ("config", "seeds", "eval_win_rate", "eval_episode_len", "minutes")})


if __name__ == "__main__":
    main()

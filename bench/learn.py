"""Learning benchmark and ablations: named configurations x seeds, each a real ``python train.py``
run, summarised as held-out win rate and steps (mean ± std over seeds), minutes and the commands.

    python bench/learn.py                                      # the default config, seeds 1 2 3
    python bench/learn.py --configs default grpo explore --seeds 1 2 3
    python bench/learn.py --configs default --seeds 1 --tag medium -- experiment=medium_cpu

Each configuration writes ``bench/results/learn_<tag>_<config>.json`` after every seed (a partial
file is still a result: it lists the seeds it has); a later invocation with other seeds and the same
overrides adds its seeds to the file (each run keeps its command, commit, threads and minutes). A run is ``python train.py <config overrides>
<extra overrides> seed=S hydra.run.dir=<runs>/<tag>/<config>/seed<S>`` in a subprocess, exactly what
a user types (its stdout and stderr in the run's ``console.log``, beside Hydra's ``train.log``), so
``textrl-report <runs>/<tag>`` groups the runs by configuration (Hydra's
overrides) and plots their curves with bands. Games and the converted model are prepared before
the clock starts; ``minutes`` is the subprocess's wall time (model loading included).

Each file records the resolved precision, whether the CPU computes bf16 natively, the torch version
and the machine of its last invocation, and each run its own (seeds added in another session may
have run on another CPU kind, in another precision): compare minutes only between runs on the same machine.

Time to a learned policy: each run records ``eval_minutes`` ([iteration, minutes since the run
started, held-out eval/win_rate] at the end of each evaluation) and ``minutes_to_win_rate``, the
minutes at which the held-out win rate first reaches 0.5, 0.8 and 0.9 (null: never); the file
aggregates them over seeds (mean and std over the seeds that reached it, how many did, every seed's
value) beside ``minutes``, the runs' total. The clock (``clock``) is the wall clock where every
evaluation wrote its transcripts (``transcripts/iter_<k>.md``, written as the evaluation ends: its
file time, since the subprocess started); else the seconds the run's phases log in metrics.csv
(``perf/rollout_s``, ``recompute_s``, ``reference_s``, ``update_s`` per iteration, ``perf/eval_s``
per evaluation), added up in run order and scaled so that the run's end is its wall time (start-up
and checkpoint writes, which no phase logs, spread in proportion).

    python bench/learn.py --resume --configs default --seeds 1 --tag medium12 -- experiment=medium_rl_rule_cpu

goes on with a run that was killed or stopped (its folder holds ``checkpoints/last.ckpt``) instead of
starting it over: a run longer than one sitting. Its minutes add up the stretches it ran (a killed
stretch until its last checkpoint; ``learn_sessions.json`` in the run's folder, and ``sessions`` in
its result entry); a resume that would change the overrides is refused, and one on a machine where
``memory=auto`` resolves another precision keeps the run's first (as ``train.py`` does).

    python bench/learn.py --from-stored bench/results/learn_easy24_*.json   # no training: printed
    python bench/learn.py --from-stored bench/results/learn_medium68_ws1024_default.json ... --out bench/results/recipes.json

puts result files side by side: each one's held-out wins (mean and std over seeds, and the 95%
Wilson interval of that mean over the held-out games: the seeds play the same games), its
minutes to each win rate and each run's episodes (``episodes``: walkthroughs cloned, PPO episodes,
and those played before each win rate was reached). Runs written before these minutes were
recorded kept the evaluation curve, each phase's mean seconds per iteration and the total minutes,
not the seconds of each iteration: their figures are estimates (each iteration and each evaluation
taken at its mean).
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
from result import command, cpu_model, write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import native_bf16
from textrl.policy.model import load_tokenizer
from textrl.results import wilson_interval
from textrl.training.datamodule import RolloutDataModule

ROOT = Path(__file__).resolve().parent.parent

# The levers of issue 12, each alone on top of the default (python train.py). The default has had
# env.goal_last=true since the easy ablation chose it; the easy12 files were measured before, when
# it was false (each run records its commit: check that commit out to reproduce one), and there
# "goal_last" was the lever and "default" the objective in the system message only. Since 2026-11-28
# the default clones training walkthroughs before PPO (256 in one pass with 24 iterations, since 2026-12-07
# 512 in two passes with 12); every earlier file measured RL alone: "rl_alone" is that default, and the
# levers below sit on the warm start now.
CONFIGS = {
    "default": [],
    "goal_first": ["env.goal_last=false"],  # the objective in the system message only (the blog post's prompt)
    "grpo": ["env.group_size=4", "ppo.advantage=grpo"],  # 4 games x 4 samples, no value head
    "rloo": ["env.group_size=4", "ppo.advantage=rloo"],
    # + each turn's return against the group's turns from the same state (GiGPO's step groups)
    "gigpo": ["env.group_size=4", "ppo.advantage=gigpo"],
    # KL anchor to the initial policy, measured on RL alone (the default is 0.1 since 2026-11-28)
    "kl": ["ppo.kl_coef=0.05"],
    "explore": ["ppo.explore=0.1"],  # 10 % uniform over each fork's children
    # the default until 68aee23 (2026-11-28): no warm start, no anchor, rewards from the game's score only
    "rl_alone": ["warm_start.steps=0", "ppo.kl_coef=0", "iterations=24"],
    # the first warm start measured: 2 passes over 64 training walkthroughs (the default: 512), then
    # PPO without the anchor, as measured then and on 2026-11-28 (learn_easy24_rule_warm16_warm_start.json)
    "warm_start": ["warm_start.steps=16", "warm_start.games=64", "ppo.kl_coef=0"],
    "list_commands": ["env.list_commands=true"],  # admissible commands shown in the prompt
    "lora_all": ["memory=lora"],  # LoRA adapters on all 30 blocks instead of the top 6 blocks
    # a command already played from the same state is not offered again in the episode (an action rule)
    "block_repeats": ["env.block_repeats=true"],
}


THRESHOLDS = (0.5, 0.8, 0.9)  # held-out win rates whose first minutes every run records
CLOCKS = {
    "wall": "wall clock since the run started, at each evaluation's transcript file (written as it ends)",
    "logged": "the phases' logged seconds (perf/*) up to each evaluation's end, scaled to the run's wall time",
    "stored_means": "estimate: each iteration and evaluation at the stored file's mean seconds, scaled to the "
                    "run's wall time",
}


def minutes_to(curve: list[list[float]], thresholds=THRESHOLDS) -> dict[str, float | None]:
    """The minutes of the first point of ``curve`` ([iteration, minutes, win rate], in run order)
    whose win rate reaches each threshold (``"0.9": minutes``); None where no point does."""
    return {str(t): next((m for _, m, win in curve if win >= t - 1e-9), None) for t in thresholds}


def eval_clock(iteration_s: dict[int, float], evals: list[tuple[int, float, float]],
               total_minutes: float | None = None) -> list[list[float]]:
    """[iteration, minutes, win rate] at the end of each evaluation, from the seconds each training
    iteration (``iteration_s``: 1-based iteration -> seconds) and each evaluation (``evals``:
    (iteration, seconds, win rate) in run order; the one after iteration k follows its update) took,
    added up in run order. With ``total_minutes`` (the run's wall time) the clock is scaled so that
    its end is the run's end: what no phase logs (start-up, checkpoint writes) is spread in
    proportion. Without it, the minutes are a lower bound."""
    logged = sum(iteration_s.values()) + sum(s for _, s, _ in evals)
    scale = total_minutes * 60 / logged if total_minutes and logged else 1.0
    curve = []
    for n, (k, _, win) in enumerate(evals):
        seconds = sum(s for i, s in iteration_s.items() if i <= k) + sum(s for _, s, _ in evals[: n + 1])
        curve.append([k, round(seconds * scale / 60, 2), win])
    return curve


def eval_minutes(rows: list[dict], total_minutes: float | None = None) -> list[list[float]]:
    """``eval_clock`` of a run's metrics.csv rows: per training row (``perf/rollout_s``) its
    rollout + recompute + reference + update seconds, per evaluation row its ``perf/eval_s``."""
    def num(row, key):
        return float(row[key]) if row.get(key) not in (None, "") else 0.0

    iteration_s = {int(float(r["iteration"])): sum(num(r, f"perf/{p}_s") for p in ("rollout", "recompute", "reference", "update"))
                   for r in rows if r.get("perf/rollout_s")}
    evals = sorted(((int(float(r["iteration"])), num(r, "perf/eval_s"), float(r["eval/win_rate"]))
                    for r in rows if r.get("eval/win_rate")), key=lambda e: e[0])
    return eval_clock(iteration_s, evals, total_minutes)


def wall_eval_minutes(run_dir: Path, sessions: list[tuple[float, float]],
                      curve: list[list]) -> list[list[float]] | None:
    """[iteration, minutes, win rate] of each evaluation of ``curve`` ([iteration, win rate, ...]):
    the run's minutes at its transcript file's time (``transcripts/iter_<k>.md``). ``sessions`` are
    the stretches the run ran, (``time.time()`` as it started, seconds it counts), one unless it was
    resumed; a file's minutes are the earlier stretches' seconds and its own stretch's up to the
    file. None where an evaluation wrote no file (``eval.transcripts=0``) or one outside every
    stretch."""
    out = []
    for it, win, *_ in curve:
        path = run_dir / "transcripts" / f"iter_{int(it):04d}.md"
        mtime = path.stat().st_mtime if path.is_file() else None
        before, at = 0.0, None
        for started, seconds in sessions:
            if mtime is not None and started <= mtime <= started + seconds:
                at = before + mtime - started
                break
            before += seconds
        if at is None:
            return None
        out.append([int(it), round(at / 60, 2), win])
    return out


def run_sessions(run_dir: Path, resume: bool, commit: str, precision: str, overrides: list[str]) -> list[dict]:
    """The stretches a seed's run has run, ``run_dir/learn_sessions.json`` (each: ``started``,
    ``seconds``, ``commit``, ``precision``, ``overrides``), with this invocation's appended (``seconds`` None until
    it ends). Without ``resume`` the run starts over: its folder is emptied. With it, a run whose
    folder holds ``checkpoints/last.ckpt`` goes on there (``train.py`` resumes by itself); a stretch
    that was killed counts until its ``last.ckpt`` was written: what the kill lost is played again
    and counted then. A resume that would change the overrides is refused (the run would mix two
    configurations); under the same overrides the precision is the run's first (``train.py`` keeps a
    checkpoint's ``memory=auto`` decision), whatever this machine's ``precision`` would be."""
    path = run_dir / "learn_sessions.json"
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    sessions = []
    if resume and ckpt.is_file():
        if not path.is_file():
            raise SystemExit(f"{run_dir} holds {ckpt.name} but no {path.name}: it was not started by "
                             f"bench/learn.py, whose minutes it could not count; run without --resume")
        sessions = json.loads(path.read_text())
        if sessions[-1]["overrides"] != overrides:
            raise SystemExit(f"{run_dir} ran with {' '.join(sessions[-1]['overrides'])} and would resume with "
                             f"{' '.join(overrides)}: resume it with the same command, or pass another --tag")
        if sessions[-1]["precision"] != precision:  # same overrides: memory=auto, decided by another machine
            print(f"{run_dir} ran in {sessions[-1]['precision']}, which memory=auto keeps from its checkpoint "
                  f"(this machine would choose {precision})", flush=True)
            precision = sessions[-1]["precision"]
        for s in sessions:
            if s["seconds"] is None:  # killed: it counts until its last checkpoint
                s["seconds"] = round(max(0.0, ckpt.stat().st_mtime - s["started"]), 1)
    elif run_dir.exists():  # a seed run again replaces its run (its logs would otherwise mix in)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    sessions.append({"started": time.time(), "seconds": None, "commit": commit, "precision": precision,
                     "overrides": overrides})
    path.write_text(json.dumps(sessions, indent=1))
    return sessions


def stored_eval_minutes(run: dict) -> list[list[float]]:
    """``eval_clock`` of a stored run (a result file's ``runs`` entry): each iteration and evaluation
    at its mean seconds (``seconds_per_iteration``), scaled to the run's ``minutes``."""
    mean = run["seconds_per_iteration"]
    per_iteration = sum(mean.get(k) or 0.0 for k in ("rollout", "recompute_old", "reference", "update"))
    evals = [(int(it), mean.get("evaluation") or 0.0, win) for it, win, *_ in run["eval_curve"]]
    return eval_clock({k: per_iteration for k in range(1, run["iterations"] + 1)}, evals, run["minutes"])


def reached(runs: list[dict]) -> dict[str, dict]:
    """Per threshold, over the runs that recorded it: every seed's minutes (None: never reached), how
    many reached it, and the mean and std of the minutes of those that did."""
    have = [r for r in runs if r.get("minutes_to_win_rate")]
    out = {}
    for t in (str(t) for t in THRESHOLDS):
        values = [r["minutes_to_win_rate"].get(t) for r in have]
        hit = [v for v in values if v is not None]
        out[t] = {"mean": round(statistics.fmean(hit), 2) if hit else None,
                  "std": round(statistics.stdev(hit), 2) if len(hit) > 1 else (0.0 if hit else None),
                  "reached": f"{len(hit)}/{len(values)}", "seeds": [r.get("seed") for r in have], "values": values}
    return out


def episodes(run: dict, curve: list[list[float]]) -> dict | None:
    """What a stored run played, from its recorded config: the training walkthroughs its warm start
    cloned, its PPO episodes (each of ``env.num_envs`` environments plays one an iteration), and the
    PPO episodes played before the first evaluation of ``curve`` that reached each win rate (0 where
    the cloned start did; None where none did). None for a run that recorded no config."""
    cfg = run.get("resolved")
    if not cfg:
        return None
    per_iteration = cfg["env"]["num_envs"]
    warm = cfg.get("warm_start", {"steps": 0})  # files from before the warm start: RL alone
    # RL alone by random play: no walkthrough; the episodes of random play that found the wins it cloned
    random_play = warm["steps"] and warm.get("source") == "random_play"
    played = {"random_play": int(run["warm_start"]["warm_start/random_episodes"])} if random_play else {}
    return {"walkthroughs": warm["games"] if warm["steps"] and not random_play else 0, **played,
            "ppo": run["iterations"] * per_iteration,
            "ppo_to_win_rate": {str(t): next((int(k) * per_iteration for k, _, win in curve if win >= t - 1e-9), None)
                                for t in THRESHOLDS}}


def from_stored(path: Path) -> dict:
    """A result file's figures side by side with every other's: the held-out wins with their interval
    (``win_rate``), the minutes to each win rate, as its runs recorded them or, for runs written
    before they were, estimated from their stored means (``stored_eval_minutes``), and the episodes
    each run played (``episodes``)."""
    data = json.loads(path.read_text())
    runs = []
    for run in data.get("runs", [data]):  # learn_cpu.json: one run, the file itself
        if run.get("minutes_to_win_rate"):
            curve, clock, to = run.get("eval_minutes"), run.get("clock"), run["minutes_to_win_rate"]
        else:
            curve = stored_eval_minutes(run)
            clock, to = CLOCKS["stored_means"], minutes_to(curve)
        runs.append({"seed": run.get("seed"), "minutes": run["minutes"], "clock": clock, "eval_minutes": curve,
                     "minutes_to_win_rate": to, "episodes": episodes(run, curve)})
    out = {"file": str(path), "minutes": mean_std([r["minutes"] for r in runs]),
           "minutes_to_win_rate": reached(runs), "runs": runs}
    if "eval_games" in data:
        out["eval_win_rate"] = win_rate([r["eval_win_rate"] for r in data["runs"]], data["eval_games"])
        out["eval_episode_len"] = data["eval_episode_len"]
    return out


def summarize_run(run_dir: Path, sessions: list[tuple[float, float]] | None = None,
                  minutes: float | None = None) -> dict:
    """A finished run's figures from its metrics.csv; with ``sessions`` (``wall_eval_minutes``) and
    ``minutes`` (its wall time), its minutes to each held-out win rate too."""
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
        # between evaluations, which a run evaluated rarely (medium_rl_rule_cpu) has no other way to show
        "rollout_curve": [[int(float(r["iteration"])), float(r["rollout/win_rate"]), float(r["rollout/episode_len"])]
                          for r in rows if r.get("rollout/win_rate")],
        # the share of turns that repeat a command from the same state: how much of the play is
        # loops, in the last evaluation and in each iteration's rollouts
        "eval_repeats": float(last["eval/repeats"]) if last.get("eval/repeats") else None,
        "rollout_repeats": [float(r["rollout/repeats"]) for r in rows if r.get("rollout/repeats")],
        "iterations": int(float(last["iteration"])),
        "seconds_per_iteration": {"rollout": mean("perf/rollout_s"), "recompute_old": mean("perf/recompute_s"),
                                  "reference": mean("perf/reference_s"), "update": mean("perf/update_s"),
                                  "evaluation": mean("perf/eval_s")},
    }
    # minutes to each held-out win rate: the wall clock where every evaluation left its transcripts
    wall = wall_eval_minutes(run_dir, sessions, out["eval_curve"]) if sessions else None
    out["clock"] = CLOCKS["wall"] if wall is not None else CLOCKS["logged"]
    out["eval_minutes"] = wall if wall is not None else eval_minutes(rows, minutes)
    out["minutes_to_win_rate"] = minutes_to(out["eval_minutes"])
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


def win_rate(values: list[float], games: int) -> dict:
    """The seeds' held-out win rates: mean, std and the 95% Wilson interval of the mean as a rate over
    the held-out games, n = ``games`` (every seed plays the same games: seeds add plays, not games)."""
    out = mean_std(values)
    return {**out, "ci95": [round(x, 3) for x in wilson_interval(out["mean"] * games, games)]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["default"], choices=sorted(CONFIGS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--tag", default="easy", help="names the result files and the runs' folder")
    ap.add_argument("--runs", default="outputs/bench_learn", help="where the runs go")
    ap.add_argument("--from-stored", nargs="+", metavar="FILE", type=Path,
                    help="no training: each result file's held-out wins with their 95%% interval and minutes to "
                         "each win rate, side by side (module docstring)")
    ap.add_argument("--out", type=Path, help="with --from-stored: also write them here, with the command")
    ap.add_argument("--resume", action="store_true",
                    help="a seed whose run folder holds checkpoints/last.ckpt (a run killed or stopped) goes on "
                         "from it instead of starting over; its minutes add up the stretches it ran (run_sessions)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides added to every configuration")
    args = ap.parse_args(argv)
    if args.out and not args.from_stored:
        ap.error("--out writes what --from-stored puts side by side: give --from-stored FILE ... too")
    if args.from_stored:
        stored = [from_stored(path) for path in args.from_stored]
        if args.out:
            write_result(str(args.out), {"files": stored}, argv)
        else:
            print(json.dumps(stored, indent=2))
        return

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
        # what memory=auto resolves to on this machine: a resumed run must keep it
        precision = train_config([*CONFIGS[name], *args.overrides]).memory.precision
        mine = []
        for seed in args.seeds:
            run_dir = (ROOT / args.runs / args.tag / name / f"seed{seed}").resolve()
            overrides = [*CONFIGS[name], *args.overrides, f"seed={seed}"]
            cmd = [sys.executable, "train.py", *overrides, f"hydra.run.dir={run_dir}"]
            sessions = run_sessions(run_dir, args.resume, commit, precision, overrides)
            run_precision = sessions[-1]["precision"]  # a resumed run's first precision
            start = time.perf_counter()
            # console.log, not train.log: that is Hydra's log file of the run, which its own handler
            # appends to while this handle writes at its own offset (lines overwrote each other)
            with open(run_dir / "console.log", "a") as log:
                subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
            sessions[-1]["seconds"] = round(time.perf_counter() - start, 1)
            (run_dir / "learn_sessions.json").write_text(json.dumps(sessions, indent=1))
            minutes = sum(s["seconds"] for s in sessions) / 60
            run = {"seed": seed, "minutes": round(minutes, 1), "command": "python train.py " + " ".join(overrides),
                   "commit": commit, "resolved": config,
                   "precision": run_precision, "cpu": cpu_model(), "cpu_native_bf16": native_bf16(False),
                   "run_dir": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
                   **summarize_run(run_dir, [(s["started"], s["seconds"]) for s in sessions], minutes)}
            if len(sessions) > 1:  # resumed: where each stretch ran (the run's commit is the last one's)
                run["sessions"] = sessions
            mine.append(run)
            # the file is read again now, not before the runs: another invocation adding other seeds
            # to the same file meanwhile (two queues side by side) keeps its runs. The file's runs of
            # seeds still to come are dropped now: they are being replaced, and may be of another
            # config (the check before the runs let them be), which must not refuse this one midway
            others, commands = earlier_runs(out_path, overrides_all, set(args.seeds), config)
            runs = sorted([*others, *mine], key=lambda r: r["seed"])
            result = {
                "config": name, "overrides": overrides_all,
                "seeds": [r["seed"] for r in runs],
                "eval_win_rate": win_rate([r["eval_win_rate"] for r in runs], resolved.eval.games),
                "eval_episode_len": mean_std([r["eval_episode_len"] for r in runs]),
                "minutes": mean_std([r["minutes"] for r in runs]),
                # the minutes until held-out wins first reach 0.5 / 0.8 / 0.9 (module docstring)
                "minutes_to_win_rate": reached(runs),
                "eval_games": resolved.eval.games, "runs": runs,
                "precision": resolved.memory.precision, "cpu_native_bf16": native_bf16(False),
                "torch": torch.__version__, "torch_threads": sorted({r["threads"] for r in runs}),
                "machine": platform.processor() or platform.machine(),
                # every invocation that added seeds to this file (this one once, though it writes after each seed)
                "commands": list(dict.fromkeys([*commands, command(argv)])),
            }
            write_result(str(out_path), result, argv,
                         show={k: result[k] for k in ("config", "seeds", "eval_win_rate", "eval_episode_len", "minutes",
                                                      "minutes_to_win_rate")})


if __name__ == "__main__":
    main()

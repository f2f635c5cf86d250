"""Every game family learned? For each family: the random policy, the untrained model and the
trained recipe (``experiment=<family>_cpu``) on the family's held-out games (the first 64; the
untrained model the first 32), with 95% intervals, and for the trained policy how the games it did
not win failed.

    python bench/families.py                                   # every family (hours on 2 cores)
    python bench/families.py --families twx_coin tw_coin       # some of them

Per family, each step is a command a user can type, and is skipped when its result is already on
disk (so the script resumes, and a family is measured once):

1. ``textrl-eval --random --env F --games 64``        -> bench/results/families/F/random/results.json
2. ``textrl-eval --model smollm2 --env F --games 32`` -> .../F/untrained/results.json (32: below)
3. ``python bench/learn.py --configs default --seeds 1 --tag family_F -- experiment=F_cpu``
   -> bench/results/learn_family_F_default.json (minutes, the training curve)
4. the run's own final evaluation (``<run>/evaluation/iter_<k>.json``, 64 held-out games, greedy: what
   ``textrl-eval --checkpoint <that run>/checkpoints/last.ckpt --games 64`` plays) -> .../F/trained/results.json,
   with the transcripts training wrote (its first ``eval.transcripts`` games); for a run from before
   training wrote that file, the ``textrl-eval`` command itself

then writes ``bench/results/families/families.json`` and ``families.md`` from every family whose
results are on disk. A family is *learned* when the trained policy beats the random one by at least
0.20 wins or wins at least 0.90 of the games (the bar of issue 33); otherwise its row names the
failure kinds of the games it did not win (``textrl/failures.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from result import command  # bench/result.py (the script directory is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "results" / "families"
# the order a full run takes: short TextWorldExpress episodes first, the longest episodes last
FAMILIES = ["twx_simonsays", "twx_peckingorder", "twx_arithmetic", "twx_sorting", "twx_coin", "twx_twc",
            "tw_coin", "tw_treasure", "twx_mapreader", "tw_cooking", "twx_cookingworld", "tw_simple"]
GAMES = 64
# the untrained model plays most games of a family to its step limit (it repeats a command): 64 games
# of a 30-step family took 14 minutes on 2 cores, so it plays half as many (its interval says so)
UNTRAINED_GAMES = 32
TRANSCRIPTS = 4  # per policy and family: enough to read a failure, cheap to write
LEARNED_MARGIN, LEARNED_WINS = 0.20, 0.90


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def textrl_eval(args: list[str], out: Path, games: int = GAMES) -> None:
    if not (out / "results.json").is_file():
        run([str(Path(sys.executable).parent / "textrl-eval"), *args, "--games", str(games),
             "--transcripts", str(TRANSCRIPTS), "--out", str(out.relative_to(ROOT))])


def measure(family: str) -> None:
    textrl_eval(["--random", "--env", family], OUT / family / "random")
    textrl_eval(["--model", "smollm2", "--env", family], OUT / family / "untrained", UNTRAINED_GAMES)
    learned = ROOT / "bench" / "results" / f"learn_family_{family}_default.json"
    if not learned.is_file():
        run([sys.executable, "bench/learn.py", "--configs", "default", "--seeds", "1", "--tag", f"family_{family}",
             "--", f"experiment={family}_cpu"])
    train = json.loads(learned.read_text())
    run_dir = train["runs"][0]["run_dir"]
    if not from_training(train, OUT / family / "trained"):
        textrl_eval(["--checkpoint", f"{run_dir}/checkpoints/last.ckpt"], OUT / family / "trained")


def from_training(train: dict, out: Path) -> bool:
    """The trained policy's result taken from its run's own final evaluation (the same greedy play on
    the same held-out games as ``textrl-eval``; ``evaluation/iter_<k>.json``), when that played
    ``GAMES`` games; False when there is none to take."""
    if (out / "results.json").is_file():
        return True
    run = train["runs"][0]
    final = ROOT / run["run_dir"] / "evaluation" / f"iter_{run['iterations']:04d}.json"
    if not final.is_file():
        return False
    summary = json.loads(final.read_text())
    if summary["games"] + len(summary["aborted"]) != GAMES:
        return False
    summary["command"] = f"{train['command']} (its final evaluation, {os.path.relpath(final, ROOT)})"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    transcripts = final.parent.parent / "transcripts" / final.name.replace(".json", ".md")
    if transcripts.is_file():
        (out / "transcripts.md").write_text(transcripts.read_text())
    print(f"{out.parent.name}: the trained row from {final}")
    return True


def row(family: str) -> dict | None:
    """One family's figures, or None until all three policies and the training run are on disk."""
    paths = {p: OUT / family / p / "results.json" for p in ("random", "untrained", "trained")}
    learned = ROOT / "bench" / "results" / f"learn_family_{family}_default.json"
    if not all(p.is_file() for p in paths.values()) or not learned.is_file():
        return None
    res = {p: json.loads(path.read_text()) for p, path in paths.items()}
    train = json.loads(learned.read_text())
    trained, random = res["trained"]["win_rate"]["mean"], res["random"]["win_rate"]["mean"]
    ok = trained - random >= LEARNED_MARGIN - 1e-9 or trained >= LEARNED_WINS - 1e-9
    return {
        "family": family, "experiment": f"{family}_cpu", "max_steps": res["trained"]["max_steps"],
        **{p: {"win_rate": r["win_rate"], "steps": r["steps"], "games": len(r["per_game"]), "failures": r["failures"],
               "command": r["command"]}
           for p, r in res.items()},
        "training": {"minutes": train["minutes"]["mean"], "iterations": train["runs"][0]["iterations"],
                     "eval_win_rate": train["eval_win_rate"]["mean"], "commit": train["runs"][0]["commit"],
                     "rollout_curve": train["runs"][0]["rollout_curve"], "precision": train["precision"],
                     # the training run's machine, not the one writing the table
                     "cpu": train.get("cpu"), "torch": train.get("torch"), "command": train["command"]},
        "learned": ok,
    }


def cell(r: dict) -> str:
    w, s = r["win_rate"], r["steps"]
    return (f"{w['mean']:.2f} [{w['ci95'][0]:.2f}, {w['ci95'][1]:.2f}] / {s['mean']:.1f}"
            + (f" ({r['games']} games)" if r["games"] != GAMES else ""))


def failures(r: dict) -> str:
    kinds = sorted(((n, k) for k, n in r["failures"].items() if n), reverse=True)
    return ", ".join(f"{k} {n}" for n, k in kinds) or "-"


def table(rows: list[dict]) -> str:
    lines = ["| family (max steps) | random | untrained | trained | minutes | learned? | trained's games not won |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r['family']}` ({r['max_steps']}) | {cell(r['random'])} | {cell(r['untrained'])} | "
                     f"{cell(r['trained'])} | {r['training']['minutes']:.1f} | {'yes' if r['learned'] else 'no'} | "
                     f"{failures(r['trained'])} |")
    return "\n".join(lines) + (
        f"\n\nEach cell: held-out wins [95% interval] / mean steps, {GAMES} games unless it says, greedy "
        f"(the random policy samples). Learned: trained >= random + {LEARNED_MARGIN:.2f} or >= {LEARNED_WINS:.2f}. "
        "Minutes: the training run's wall time (`experiment=<family>_cpu`, its final evaluation included).\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    ap.add_argument("--table-only", action="store_true", help="no runs: the table from the results on disk")
    args = ap.parse_args(argv)
    if not args.table_only:
        for family in args.families:
            measure(family)
    rows = [r for r in (row(f) for f in FAMILIES) if r is not None]
    OUT.mkdir(parents=True, exist_ok=True)
    # each row's training carries its precision, CPU and torch: minutes compare only on one machine
    (OUT / "families.json").write_text(json.dumps({"rows": rows, "command": command(argv)}, indent=2) + "\n")
    (OUT / "families.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()

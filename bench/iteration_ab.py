"""The A/B of ``bench/iteration.py``: this tree against an older commit's, in alternating rounds.

One run of ``bench/iteration.py`` on a shared 2-core machine moves by 10-20 % between runs minutes
apart (its forward bound alone read 619 and 691 tokens/s in two runs of one session), more than
the differences an A/B is after. So the two trees run in turns, ``--rounds`` times, the order
swapped every round (before/now, now/before, ...) so that a drift of the machine weighs on both
alike; each round gives one ratio (now / before, mean iteration wall time) and the median round's
two files become ``bench/results/iteration.json`` and ``iteration_before.json``.

``--before`` is a work tree of the older commit (``git worktree add --detach <dir> <commit>``); its
own package is imported there (``PYTHONPATH``), this tree's ``bench/iteration.py`` measures both.
Writes ``bench/results/iteration_ab.json`` (every round's figures, the median and range of the
ratio) and each run's file under ``bench/results/iteration_ab/``.

    python bench/iteration_ab.py --before ../before --rounds 3 -- env.goal_last=false

``--before-overrides``: the older tree's own overrides where the same run is spelled differently
there (an experiment renamed since, an option that was then the default), in place of the shared
ones; both sets are recorded.

    python bench/iteration_ab.py --before ../before --before-overrides "experiment=medium_cpu" -- experiment=medium_rl_rule_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from result import write_result  # bench/result.py (the script directory is on sys.path)

ROOT = Path(__file__).resolve().parent.parent


def run(tree: Path, out: Path, overrides: list[str]) -> dict:
    """One ``bench/iteration.py`` run importing ``tree``'s textrl; its result file, read back."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, str(ROOT / "bench" / "iteration.py"), "--out", str(out), "--", *overrides],
                   cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def summary(result: dict) -> dict:
    its = result["iterations"]
    return {"commit": result["textrl_commit"], "iteration_wall_s_mean": result["iteration_wall_s_mean"],
            "wall_s": [it["wall_s"] for it in its], "forward_tokens_per_s": result["bounds"]["forward_tokens_per_s"],
            "rollout_vs_bound": [it.get("rollout", {}).get("rollout_vs_bound") for it in its],
            "update_vs_bound": [it["update"]["update_vs_bound"] for it in its]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="a work tree of the older commit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/iteration_ab.json")
    ap.add_argument("--before-overrides", default=None,
                    help="the older tree's Hydra overrides, one shell-quoted string, in place of the shared ones")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the training run (both trees)")
    args = ap.parse_args(argv)
    before_overrides = args.overrides if args.before_overrides is None else shlex.split(args.before_overrides)
    before = Path(args.before).resolve()
    if not (before / "textrl").is_dir():
        raise SystemExit(f"--before {args.before}: no textrl package there; make a work tree of the older "
                         f"commit with: git worktree add --detach {args.before} <commit>")
    results = Path(args.out).parent
    runs_dir = results / "iteration_ab"
    runs_dir.mkdir(parents=True, exist_ok=True)

    rounds = []
    for k in range(args.rounds):
        order = [("before", before), ("now", ROOT)] if k % 2 == 0 else [("now", ROOT), ("before", before)]
        files = {}
        for name, tree in order:
            path = runs_dir / f"round{k + 1}_{name}.json"
            files[name] = (path, run(tree, path.resolve(), before_overrides if name == "before" else args.overrides))
        now, old = files["now"][1], files["before"][1]
        rounds.append({"order": [name for name, _ in order], "now": summary(now), "before": summary(old),
                       "ratio": now["iteration_wall_s_mean"] / old["iteration_wall_s_mean"],
                       "files": {name: str(f) for name, (f, _) in files.items()}})
        print(f"round {k + 1}: ratio {rounds[-1]['ratio']:.3f}", flush=True)

    ratios = [r["ratio"] for r in rounds]
    median = sorted(range(len(rounds)), key=lambda i: ratios[i])[len(rounds) // 2]
    for name, target in (("now", "iteration.json"), ("before", "iteration_before.json")):
        (results / target).write_text(Path(rounds[median]["files"][name]).read_text())
    out = {"ratio_median": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
           "median_round": median + 1, "rounds": rounds, "overrides": args.overrides,
           "before_overrides": before_overrides}
    write_result(args.out, out, argv)


if __name__ == "__main__":
    main()

"""Reference points for the learning curves: the random policy and the untrained model, played on
held-out games of every difficulty with textrl-eval's code (greedy for the model).

    python bench/baselines.py                       # random + untrained smollm2, 64 games each
"""

from __future__ import annotations

import argparse

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.cli.evaluate import evaluate
from textrl.games.pool import DIFFICULTIES


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--difficulties", nargs="+", default=["easy", "medium", "hard"], choices=sorted(DIFFICULTIES))
    ap.add_argument("--policies", nargs="+", default=["random", "model:smollm2"],
                    help="random, model:<name> (untrained) or checkpoint:<path>")
    ap.add_argument("--games", type=int, default=64)
    ap.add_argument("--out", default="bench/results/baselines.json")
    args = ap.parse_args(argv)

    results = {}
    for difficulty in args.difficulties:
        for policy in args.policies:
            summary, _ = evaluate(policy, difficulty, args.games)
            summary.pop("per_game")
            results.setdefault(difficulty, {})[policy] = summary
            print(difficulty, policy, {k: summary[k] for k in ("win_rate", "steps", "return")}, flush=True)
    write_result(args.out, {"games": args.games, "results": results}, argv)


if __name__ == "__main__":
    main()

"""Paired, game-by-game comparison of two policies on the same held-out games: did PPO beat the
cloned policy it started from?

    python bench/paired.py --pair CLONED/evaluation/iter_0000.json PPO/evaluation/iter_0008.json \
        [--pair ...] --out bench/results/<name>.json

Each ``--pair BEFORE AFTER`` is two evaluations of the same games (``textrl-eval``'s
``results.json`` or a run's ``evaluation/iter_<k>.json``, both with ``per_game``), one pair per
seed. Games are matched by name; two files that did not play the same games are refused. Pooled
over the pairs:

- **wins**: the games lost before and won after (``gained``) and the reverse (``lost``), with the
  exact two-sided sign test (McNemar's exact test) on those discordant games: the chance of a split
  at least this uneven if PPO changed nothing;
- **steps**: the mean of each game's steps after minus before, with a 95% normal interval.

A single pair's win rates alone cannot say this: two policies at 0.83 may win different games.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from result import write_result  # bench/result.py (the script directory is on sys.path)


def sign_test(gained: int, lost: int) -> float:
    """Exact two-sided p-value of ``gained`` against ``lost`` discordant games under p = 1/2."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def per_game(path: Path) -> dict[str, dict]:
    result = json.loads(path.read_text())
    if "per_game" not in result:
        raise SystemExit(f"error: {path} has no per_game (a textrl-eval results.json or a run's evaluation file)")
    return {g["game"]: g for g in result["per_game"]}


def compare(pairs: list[tuple[Path, Path]]) -> dict:
    rows, diffs, gained, lost = [], [], 0, 0
    for before_path, after_path in pairs:
        before, after = per_game(before_path), per_game(after_path)
        if set(before) != set(after):
            raise SystemExit(f"error: {before_path} and {after_path} played different games "
                             f"({len(set(before) ^ set(after))} not in both)")
        g = sum(not before[k]["won"] and after[k]["won"] for k in before)
        l = sum(before[k]["won"] and not after[k]["won"] for k in before)
        d = [after[k]["steps"] - before[k]["steps"] for k in sorted(before)]
        gained, lost, diffs = gained + g, lost + l, diffs + d
        rows.append({"before": str(before_path), "after": str(after_path), "games": len(before),
                     "wins_before": sum(x["won"] for x in before.values()) / len(before),
                     "wins_after": sum(x["won"] for x in after.values()) / len(after),
                     "steps_before": statistics.fmean(x["steps"] for x in before.values()),
                     "steps_after": statistics.fmean(x["steps"] for x in after.values()),
                     "gained": g, "lost": l})
    mean = statistics.fmean(diffs)
    half = 1.959963984540054 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return {"pairs": rows, "games": len(diffs), "gained": gained, "lost": lost,
            "sign_test_p": sign_test(gained, lost),
            "wins_before": statistics.fmean(r["wins_before"] for r in rows),
            "wins_after": statistics.fmean(r["wins_after"] for r in rows),
            "steps_change": {"mean": mean, "ci95": [mean - half, mean + half]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", nargs=2, action="append", required=True, metavar=("BEFORE", "AFTER"),
                    help="two evaluations of the same games (one pair per seed)")
    ap.add_argument("--out", required=True, help="bench/results/<name>.json")
    args = ap.parse_args(argv)
    result = compare([(Path(a), Path(b)) for a, b in args.pair])
    write_result(args.out, result, argv, show={k: v for k, v in result.items() if k != "pairs"})
    return 0


if __name__ == "__main__":
    sys.exit(main())

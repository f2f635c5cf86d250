"""Seconds to generate easy games with worker processes, and to load them back from the cache.

    python bench/games.py                 # 64 easy games, 2 workers, into a fresh cache directory
"""

from __future__ import annotations

import argparse
import tempfile
import time

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import env_options
from textrl.games.pool import GamePool


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", "--difficulty", dest="env", default="easy", choices=env_options())
    ap.add_argument("--games", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="bench/results/games.json")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as cache:  # always a cold cache: generation is what is measured
        pool = GamePool(args.env, cache_dir=cache, workers=args.workers)
        start = time.perf_counter()
        games = pool.games("train", args.games)
        generate_s = time.perf_counter() - start
        generated = pool.generated

        again = GamePool(args.env, cache_dir=cache, workers=args.workers)
        start = time.perf_counter()
        loaded = again.games("train", args.games)
        load_s = time.perf_counter() - start
        assert loaded == games and again.generated == 0

    out = {
        "difficulty": args.env,
        "games": len(games),
        "workers": args.workers,
        "generated": generated,
        "generate_s": round(generate_s, 2),
        "load_from_cache_s": round(load_s, 4),
        "targets": {"generate_s": 60, "load_from_cache_s": 2},
    }
    write_result(args.out, out, argv)


if __name__ == "__main__":
    main()

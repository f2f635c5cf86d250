"""Seconds to generate easy games with worker processes, and to load them back from the cache; then
environment steps per second of a random agent through textrl's own env (``open_game``) on
TextWorld and TextWorldExpress games, in the same run on the same machine, and their ratio.

    python bench/games.py                 # 64 easy games, 2 workers, into a fresh cache directory
    python bench/games.py --step-envs easy tw_cooking twx_cookingworld twx_coin --step-seconds 10
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import env_options, load_env_config
from textrl.games.env import open_game
from textrl.games.pool import GamePool, GameSpec


def steps_per_s(name: str, seconds: float, games: int = 8) -> float:
    """A uniformly random admissible command every step, on ``games`` held-out games of the env
    option in turn (reset when an episode ends), for ``seconds``; resets and stepping counted."""
    env = load_env_config(name)
    paths = GamePool(GameSpec.from_env(env)).games("eval", games)  # generated before the clock starts
    rng = random.Random(0)
    steps, k, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        game = open_game(paths[k % games], env)
        obs, k = game.reset(), k + 1
        while True:
            result = game.step(rng.choice(obs.admissible_commands))
            steps, obs = steps + 1, result.observation
            if result.done:
                break
        game.close()
    return steps / (time.perf_counter() - start)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", "--difficulty", dest="env", default="easy", choices=env_options())
    ap.add_argument("--games", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--step-envs", nargs="+", default=["easy", "tw_cooking", "twx_cookingworld", "twx_coin"],
                    choices=env_options(), help="env options whose random-agent steps per second are measured")
    ap.add_argument("--step-seconds", type=float, default=10.0, help="seconds of stepping per env option")
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
        "random_agent_steps_per_s": {name: round(steps_per_s(name, args.step_seconds), 1) for name in args.step_envs},
    }
    rate = out["random_agent_steps_per_s"]
    if "tw_cooking" in rate and "twx_cookingworld" in rate:  # the same kind of game in both engines
        out["ratio_twx_cookingworld_to_tw_cooking"] = round(rate["twx_cookingworld"] / rate["tw_cooking"], 1)
    write_result(args.out, out, argv)


if __name__ == "__main__":
    main()

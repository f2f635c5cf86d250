"""How much of a rollout is spent on the games: in the training process vs on worker processes.

For each number of environments (``--envs``, default 16 and 64) the default policy (untrained
SmolLM2, the default easy env and prompt, the run's autocast) plays one sampled episode per env,
first with the games stepping one after the other in this process, then held by ``--workers``
processes (``env.step_workers``: two groups of games, one stepping while the other decodes). Same
games and seeds in both. ``--groups 1 2 4`` also measures the games in process decoded as that many
groups (``env.decode_groups``), to separate what the grouping saves from what the workers do. Reported per setting: rollout seconds, the loop's seconds on games
(stepping, or waiting for the workers' answers) and their share. Writes ``bench/results/env_wait.json``.

    python bench/env_wait.py                      # 16 and 64 envs, 2 workers
    python bench/env_wait.py --envs 64 --workers 4
"""

from __future__ import annotations

import argparse
import platform

import torch

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import load_env_config, load_model_config, native_bf16
from textrl.games.pool import GamePool, GameSpec
from textrl.games.workers import GameWorkers
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.model import build_policy
from textrl.policy.speed.precision import autocast_context, resolve_precision
from textrl.rollout import Player, Sampling, episode_seeds, play_games


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--groups", type=int, nargs="+", default=[1],
                    help="in process: decode the envs as this many groups (env.decode_groups), each measured")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--env", default="easy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/env_wait.json")
    args = ap.parse_args(argv)

    env = load_env_config(args.env)
    policy, tokenizer = build_policy(load_model_config(args.model))
    policy.eval()
    precision = resolve_precision("auto", policy, "cpu")  # as training's memory=auto decides
    workers = GameWorkers(args.workers)
    results = []
    try:
        for n in args.envs:
            games = GamePool(GameSpec.from_env(env), workers=env.workers).games("train", n)
            seeds = episode_seeds(args.seed, 0, games)
            for where, groups in [*(("process", g) for g in args.groups), ("workers", 2)]:
                player = Player(policy, tokenizer, [ConstrainedDecoder(policy, drop_cut_turns=env.drop_turns_from_cache)
                                                    for _ in range(groups)],
                                autocast=lambda: autocast_context(precision, "cpu"),
                                workers=workers if where == "workers" else None)
                episodes, stats = play_games(player, games, env, Sampling(1.0, seeds))
                row = {"envs": n, "games": where, "workers": args.workers if where == "workers" else 0,
                       "decode_groups": groups,
                       "rollout_s": round(stats.seconds, 2), "env_s": round(stats.env_s, 2),
                       "env_share": round(stats.env_s / stats.seconds, 4), "turns": stats.turns,
                       "model_s": round(stats.decode.model_s, 2)}
                results.append(row)
                print(row, flush=True)
    finally:
        workers.close()
    out = {"results": results, "model": args.model, "env": args.env, "precision": precision,
           "cpu_native_bf16": native_bf16(False), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine()}
    write_result(args.out, out, argv, show={"results": results})


if __name__ == "__main__":
    main()

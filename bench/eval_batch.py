"""How many games an evaluation decodes together (``eval.batch``, ``textrl-eval --batch``): the
seconds one policy takes to play the same held-out games greedily at each batch size, in
alternating rounds in one process, and whether every game's result is the same at every size.

    python bench/eval_batch.py --checkpoint RUN/checkpoints/last.ckpt --out bench/results/eval_batch_easy.json

A batch is played until its last game ends (won, lost or at the step limit), so a game that loops
holds the rows that finished beside it; larger batches overlap those waits but decode longer calls:
which wins is a measurement per machine and setting."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from result import write_result
from textrl.cli.evaluate import evaluate, load_source


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a training checkpoint (.ckpt)")
    ap.add_argument("--games", type=int, default=64, help="held-out games played at each size")
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64], help="eval batch sizes")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each size once per round, alternating")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    loaded = load_source(f"checkpoint:{args.checkpoint}", None)
    seconds = {b: [] for b in args.sizes}
    results, precision = {}, None
    for r in range(args.rounds):
        for b in args.sizes if r % 2 == 0 else list(reversed(args.sizes)):
            t = time.perf_counter()
            summary, episodes, _ = evaluate(f"checkpoint:{args.checkpoint}", games=args.games, batch=b,
                                            loaded=loaded, transcripts=0)
            seconds[b].append(time.perf_counter() - t)
            results[b] = [(e.won, len(e.steps)) for e in episodes]
            precision = summary["precision"]
    first = args.sizes[0]
    write_result(args.out, {
        "checkpoint": args.checkpoint, "games": args.games, "precision": precision,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "win_rate": sum(w for w, _ in results[first]) / args.games,
        "same_games_at_every_size": all(results[b] == results[first] for b in args.sizes),
        "seconds": {str(b): {"median": statistics.median(s), "all": s} for b, s in seconds.items()},
        "speedup_over_first": {str(b): statistics.median(seconds[first]) / statistics.median(s)
                               for b, s in seconds.items()},
    }, argv)


if __name__ == "__main__":
    main()

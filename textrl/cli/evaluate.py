"""textrl-eval: greedy play on held-out games, with 95% confidence intervals and transcripts.

    textrl-eval --checkpoint outputs/<run>/checkpoints/best-10.ckpt        # a trained policy
    textrl-eval --model smollm2 --difficulty medium --games 64             # an untrained model
    textrl-eval --random --difficulty hard                                 # uniformly random commands

The games are the first N evaluation games of the difficulty (the same held-out set training
evaluates on; never a training game). Writes ``<out>/results.json`` (win rate, steps, return: mean
and 95% interval, plus every game) and ``<out>/transcripts.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import statistics
import sys
from pathlib import Path

import torch

from textrl.config import load_env_config, load_model_config, native_bf16
from textrl.games.env import TextGame
from textrl.games.pool import DIFFICULTIES, GamePool
from textrl.games.prompt import PromptBuilder
from textrl.policy.checkpoint import CheckpointError, load_checkpoint_policy
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.model import ModelNotFoundError, build_policy
from textrl.rollout import Episode, play, play_uniform
from textrl.transcripts import write_transcripts

log = logging.getLogger(__name__)

Z95 = 1.959964  # two-sided 95% normal quantile


def wilson_interval(wins: int, n: int) -> list[float]:
    """95% Wilson score interval of a win rate: stays inside [0, 1] and is sensible at 0 or n wins."""
    if n == 0:
        return [0.0, 1.0]
    p = wins / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def mean_interval(values: list[float]) -> list[float]:
    """95% normal interval of a mean (mean +- 1.96 standard errors)."""
    mean = statistics.fmean(values)
    half = Z95 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return [mean - half, mean + half]


def summarize(episodes: list[Episode]) -> dict:
    wins = sum(e.won for e in episodes)
    steps = [float(e.length) for e in episodes]
    returns = [e.total_return for e in episodes]
    return {
        "games": len(episodes),
        "win_rate": {"mean": wins / len(episodes), "ci95": wilson_interval(wins, len(episodes))},
        "steps": {"mean": statistics.fmean(steps), "ci95": mean_interval(steps)},
        "return": {"mean": statistics.fmean(returns), "ci95": mean_interval(returns)},
        "per_game": [{"game": Path(e.game).parent.name, "won": e.won, "steps": e.length,
                      "return": round(e.total_return, 6)} for e in episodes],
    }


def evaluate(policy_source: str, difficulty: str | None = None, games: int = 64, batch: int = 32, seed: int = 0,
             cache_dir: str | None = None, device: str | None = None) -> tuple[dict, list[Episode]]:
    """Play ``games`` held-out games. ``policy_source``: ``random``, ``model:<name>`` (untrained) or
    ``checkpoint:<path>``. Returns the summary and the episodes."""
    env = None
    precision = "auto"  # an untrained model: bf16 where the device has it natively, as training
    if policy_source == "random":
        policy = tokenizer = None
    elif policy_source.startswith("model:"):
        policy, tokenizer = build_policy(load_model_config(policy_source.removeprefix("model:")), cache_dir=cache_dir)
    elif policy_source.startswith("checkpoint:"):
        policy, tokenizer, cfg = load_checkpoint_policy(policy_source.removeprefix("checkpoint:"))
        env, cache_dir = cfg.env, cache_dir or cfg.cache_dir
        difficulty = difficulty or env.difficulty
        precision = cfg.memory.precision  # play under the autocast it was trained (and evaluated) with
    else:
        raise ValueError(f"policy must be 'random', 'model:<name>' or 'checkpoint:<path>', got {policy_source!r}")
    difficulty = difficulty or "easy"
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {sorted(DIFFICULTIES)}")
    env = env or load_env_config(difficulty)  # the prompt budget training uses on this difficulty
    paths = GamePool(difficulty, cache_dir=cache_dir, workers=env.workers).games("eval", games)
    max_steps = env.max_steps or DIFFICULTIES[difficulty].max_steps
    autocast = contextlib.nullcontext()
    if policy is None:
        precision = None
    else:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if precision == "auto":
            precision = "bf16-mixed" if native_bf16(device == "cuda") else "32-true"
        dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        if dtype is not None:
            autocast = torch.autocast(device, dtype=dtype)
        policy.to(device).eval()
        prompts = PromptBuilder.for_env(tokenizer, env)
        decoder = ConstrainedDecoder(policy, tokenizer.pad_token_id)
    episodes: list[Episode] = []
    for start in range(0, len(paths), batch):
        envs = [TextGame(p, max_steps, env.step_penalty, env.win_bonus, env.history_len)
                for p in paths[start:start + batch]]
        try:
            if policy is None:
                episodes += play_uniform(envs, seed)[0]
            else:
                with torch.no_grad(), autocast:
                    episodes += play(envs, decoder, prompts, greedy=True)[0]
        finally:
            for e in envs:
                e.close()
        # An untrained model on medium/hard plays every game to the step limit: minutes per batch.
        log.info("played %d/%d %s games, %d won", len(episodes), len(paths), difficulty, sum(e.won for e in episodes))
    summary = {"policy": policy_source, "difficulty": difficulty, "max_steps": max_steps,
               "greedy": policy is not None, "precision": precision, **summarize(episodes)}
    return summary, episodes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="textrl-eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a training checkpoint (.ckpt)")
    which.add_argument("--model", help="an untrained model config: gpt2, qwen, smollm2, tiny")
    which.add_argument("--random", action="store_true", help="the uniformly random admissible-command baseline")
    ap.add_argument("--difficulty", choices=sorted(DIFFICULTIES), help="default: the checkpoint's, else easy")
    ap.add_argument("--games", type=int, default=64, help="held-out games to play (default 64)")
    ap.add_argument("--batch", type=int, default=32, help="games decoded together")
    ap.add_argument("--seed", type=int, default=0, help="random policy only")
    ap.add_argument("--transcripts", type=int, default=None, help="games to transcribe (default: all)")
    ap.add_argument("--out", help="output directory (default eval/<policy>-<difficulty>)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.games < 1 or args.batch < 1:
        ap.error("--games and --batch must be >= 1")
    source = ("random" if args.random else f"model:{args.model}" if args.model else f"checkpoint:{args.checkpoint}")
    try:
        summary, episodes = evaluate(source, args.difficulty, args.games, args.batch, args.seed)
    except (CheckpointError, ModelNotFoundError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    name = "random" if args.random else args.model or Path(args.checkpoint).stem
    out = Path(args.out or f"eval/{name}-{summary['difficulty']}")
    out.mkdir(parents=True, exist_ok=True)
    summary["command"] = " ".join(["textrl-eval", *(argv if argv is not None else sys.argv[1:])])
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    shown = episodes if args.transcripts is None else episodes[: args.transcripts]
    write_transcripts(shown, out / "transcripts.md",
                      f"{source} on {len(episodes)} held-out {summary['difficulty']} games: win rate "
                      f"{summary['win_rate']['mean']:.2f}")
    for key in ("win_rate", "steps", "return"):
        lo, hi = summary[key]["ci95"]
        print(f"{key:>9}: {summary[key]['mean']:.3f}  (95% CI {lo:.3f} .. {hi:.3f})")
    print(f"wrote {out / 'results.json'} and {out / 'transcripts.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

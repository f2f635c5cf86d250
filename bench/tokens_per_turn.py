"""Tokens a turn costs the rollout and the update, with cut turns dropped from the KV cache and without.

When an episode's history is cut, the decoder drops the cut turns from the row's cache and feeds
only the new tokens (``textrl.policy.speed.stream``); without that (what it does under an attention
implementation other than textrl's SDPA, ``model.attn_implementation``, or with
``env.drop_turns_from_cache=false``) a cut row feeds its whole prompt again from position 0. For each difficulty this plays the same training games with the
same seeds both ways and counts, per turn (one command):

* rollout: the tokens the decoder's model calls feed (prompts and fork levels);
* update: the tokens of the training sequences, i.e. what one pass of the update forwards.

A count, not a speed: it depends on the prompts, the tokenizer and how long the episodes run. The
policy is ``--model`` (default ``tiny``: randomly initialised, with SmolLM2's tokenizer, so its
episodes run to the step limit about as often as a random policy's; an untrained policy is what
the first iterations see). ``--positions``: the model's positions (the tiny model has 4,096;
SmolLM2, the default model, 8,192): a stream that would pass them starts again from position 0.

    python bench/tokens_per_turn.py --envs easy medium hard --games 16 --positions 8192
"""

from __future__ import annotations

import argparse

import torch
from result import write_result  # bench/result.py (the script directory is on sys.path)

from textrl.config import load_env_config, load_model_config
from textrl.games.env import open_game
from textrl.games.pool import GamePool, GameSpec
from textrl.games.prompt import PromptBuilder
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.model import build_policy
from textrl.ppo.sequences import training_sequences
from textrl.rollout import Sampling, decode_episodes


def count(policy, tokenizer, env, games, keep: bool) -> dict:
    decoder = ConstrainedDecoder(policy, drop_cut_turns=keep)
    prompts = PromptBuilder.for_env(tokenizer, env)
    envs = [open_game(g, env) for g in games]
    with torch.no_grad():
        episodes, _ = decode_episodes(envs, [decoder], prompts, Sampling(1.0, list(range(len(games)))))
    for e in envs:
        e.close()
    turns = sum(len(e.steps) for e in episodes)
    rollout = decoder.counts["prefill_tokens"] + decoder.counts["fork_tokens"]
    sequences = training_sequences(episodes).sequences
    update = sum(len(s.input_ids) for s in sequences)
    return {"turns": turns, "rollout_tokens": rollout, "update_tokens": update, "sequences": len(sequences),
            "cuts": sum(len({d.at for d in s.drops}) for s in sequences),
            "rollout_tokens_per_turn": rollout / turns, "update_tokens_per_turn": update / turns,
            "wins": sum(e.won for e in episodes)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", nargs="+", default=["easy", "medium", "hard"])
    ap.add_argument("--games", type=int, default=16)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--positions", type=int, default=None, help="override the model's max_position_embeddings")
    ap.add_argument("--out", default="bench/results/tokens_per_turn.json")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    overrides = {} if args.positions is None else {"architecture": {"max_position_embeddings": args.positions}}
    policy, tokenizer = build_policy(load_model_config(args.model, **overrides))
    policy.eval()
    out = {"model": args.model, "positions": policy.position_limit, "games": args.games, "torch": torch.__version__, "envs": {}}
    for name in args.envs:
        env = load_env_config(name)
        games = GamePool(GameSpec.from_env(env)).games("train", args.games)
        kept, refed = count(policy, tokenizer, env, games, True), count(policy, tokenizer, env, games, False)
        out["envs"][name] = {
            "history_len": env.history_len, "max_steps": env.max_steps, "max_prompt_tokens": env.max_prompt_tokens,
            "cuts_kept": kept, "cuts_refed": refed,
            "rollout_ratio": kept["rollout_tokens_per_turn"] / refed["rollout_tokens_per_turn"],
            "update_ratio": kept["update_tokens_per_turn"] / refed["update_tokens_per_turn"]}
        print(name, {k: round(v, 3) for k, v in out["envs"][name].items() if k.endswith("ratio")}, flush=True)
    write_result(args.out, out, argv)


if __name__ == "__main__":
    main()

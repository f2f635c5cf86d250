"""What packing several sequences into one update forward buys (``ppo.minibatch_size``), on the
sequences a run trains on.

The update and the warm start run ``decision_forward`` over minibatches of training sequences:
under textrl's attention a minibatch is packed back to back in one row, so the linear layers
multiply all its tokens in one product while attention stays per sequence. This script times that
forward and its backward over the walkthrough sequences of ``--games`` training games of the
configured env (what the warm start clones; after it, the update's easy sequences are as short),
with the run's precision (``memory=auto`` resolved here), the weights cast once per pass and the
top ``model.trainable_layers`` blocks trainable, at each of ``--sizes`` sequences per forward:

* ``recording_s``: a pass whose forwards run every block and record the frozen blocks' output
  (``ppo.cache_frozen``): the warm start's first pass over a walkthrough;
* ``replayed_s``: a second pass replaying the recordings, so only the trainable blocks run: every
  later cloning pass, and every pass of the PPO update over a rollout's sequences.

The sizes run in ``--rounds`` rounds, the order reversed every other round; ``vs_first`` is a round's
ratio of the first size's seconds to each size's, ``summary`` the median over rounds. Before the
timed rounds one untimed pass at each size warms the process (its first forwards measure the CPU
attention and cast the weights). ``max_logprob_diff`` is the largest difference of a decision's
log-prob between each size and the first, one forward each (rounding only: the same computation).

    python bench/packed_update.py --out bench/results/packed_update_epyc_avx512.json
    python bench/packed_update.py --games 32 --sizes 1 4 -- env=medium
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from result import write_result  # bench/result.py (the script directory is on sys.path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", type=int, default=64, help="training games whose walkthroughs are the sequences")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8], help="sequences per forward")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/packed_update.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the training config")
    args = ap.parse_args(argv)

    from compose import train_config  # bench/compose.py: memory=auto decided as a run decides it
    from textrl.games.pool import GamePool, GameSpec
    from textrl.games.prompt import PromptBuilder
    from textrl.policy.distribution import fork_logprobs
    from textrl.policy.model import build_policy
    from textrl.policy.speed import FrozenPrefix
    from textrl.ppo.sequences import PrefixOutputs, decision_forward, training_sequences
    from textrl.training.warm_start import make_fabric, walkthrough_episodes

    cfg = train_config(args.overrides)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty, cfg.cache_dir, cfg.memory)
    prompts = PromptBuilder.for_env(tokenizer, cfg.env)
    games = GamePool(GameSpec.from_env(cfg.env), cache_dir=cfg.cache_dir, workers=cfg.env.workers).games("train", args.games)
    episodes, _ = walkthrough_episodes(games, prompts, cfg)
    sequences = training_sequences(episodes).sequences
    tokens = sum(len(s.input_ids) for s in sequences)
    fabric = make_fabric(cfg)
    policy.to(fabric.device).train()
    frozen = FrozenPrefix.of(policy.lm)
    pad = tokenizer.pad_token_id

    def logprobs(batch, prefix):
        d = decision_forward(policy, batch, pad, prefix)
        return fork_logprobs(d.logits, d.valid).gather(1, d.chosen[:, None]).squeeze(1)

    def one_pass(size: int, prefix) -> float:
        start = time.perf_counter()
        with fabric.autocast(), policy.weights_cast_once():
            for i in range(0, len(sequences), size):
                fabric.backward(-logprobs(sequences[i: i + size], prefix).float().sum())
        policy.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def passes(size: int) -> dict:
        prefix = PrefixOutputs(frozen, [None] * len(sequences)) if frozen is not None else None
        return {"recording_s": one_pass(size, prefix), "replayed_s": one_pass(size, prefix)}

    for size in args.sizes:  # warm-up, untimed
        passes(size)
    with torch.no_grad(), fabric.autocast(), policy.weights_cast_once():
        ref = [logprobs(sequences[i: i + args.sizes[0]], None) for i in range(0, len(sequences), args.sizes[0])]
        ref = torch.cat(ref)
        diffs = {}
        for size in args.sizes:
            got = torch.cat([logprobs(sequences[i: i + size], None) for i in range(0, len(sequences), size)])
            diffs[str(size)] = float((got.float() - ref.float()).abs().max())

    rounds = []
    for r in range(args.rounds):
        order = args.sizes if r % 2 == 0 else list(reversed(args.sizes))
        timed = {size: passes(size) for size in order}
        first = timed[args.sizes[0]]
        rounds.append({str(size): {**t, **{f"{k}_vs_first": first[k] / t[k] for k in t},
                                   **{f"{k[:-2]}_tokens_per_s": tokens / t[k] for k in t}}
                       for size, t in sorted(timed.items())})
    summary = {str(size): {k: statistics.median(r[str(size)][k] for r in rounds) for k in rounds[0][str(size)]}
               for size in args.sizes}
    result = {"env": cfg.env.name, "model": cfg.model.name, "precision": cfg.memory.precision,
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "trainable_layers": cfg.model.trainable_layers, "frozen_replayed": frozen is not None,
              "sequences": len(sequences), "tokens": tokens, "mean_tokens": tokens / max(len(sequences), 1),
              "sizes": args.sizes, "max_logprob_diff": diffs, "rounds": rounds, "summary": summary}
    write_result(args.out, result, argv, show={"summary": summary, "max_logprob_diff": diffs})
    return result


if __name__ == "__main__":
    main()

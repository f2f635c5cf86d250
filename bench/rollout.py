"""Decisions per second of the rollout loop: this decoder vs. the blog post's naive decoder.

The naive decoder is the blog post's method: at every decision it re-pads and re-encodes the whole
prompt plus the partial command for all environments still choosing, with no KV cache. It is made
as fast as that method allows: it computes the logits of the last position only (the blog post took the
full-vocabulary logits of every position) and reads only the allowed children's, as the cached
decoder does. Both decoders play the same games from the same seeds through training's
``play_games`` (the env's prompt, the run's autocast -- ``memory=auto``: the faster of bf16 and fp32 on this CPU
-- and the frozen weights held in its dtype); only the decoder differs. (Results before the commit
that introduced ``play_games`` used a fixed 2,048-token prompt budget without ``env.goal_last``:
compare figures only within one result file.) Rounds alternate the two
decoders (cached, naive, cached, naive, ...) so that a slow stretch of the machine hits both; the
speed-up is the ratio of the median rounds, with the range of each. Both decode the envs in the same
groups (``--groups``, default training's on a CPU, ``env.decode_groups``), each group its own batch:
grouping cuts the naive decoder's padding (the cached decoder's packed calls compute none).

    python bench/rollout.py                      # model=smollm2, 16 easy environments, 3 rounds
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import default_decode_groups, env_options, load_env_config, load_model_config, native_bf16
from textrl.games.pool import GamePool, GameSpec
from textrl.policy.decoding import ConstrainedDecoder, Cursor, choose, recorded_temperature
from textrl.policy.model import PolicyValueModel, build_policy
from textrl.policy.speed.precision import autocast_context, resolve_precision
from textrl.rollout import Player, Sampling, episode_seeds, play_games


class NaiveDecoder:
    """Re-encodes everything for every decision token (the blog post's decoder), same sampling rule."""

    def __init__(self, policy: PolicyValueModel, pad_id: int):
        self.policy = policy
        self.pad_id = pad_id

    def reset(self, record: bool = False) -> None:  # nothing is kept between calls, nothing recorded
        pass

    @torch.no_grad()
    def act(self, slots, prompts, tries, temperature=1.0, greedy=False, rngs=None, explore=0.0):
        temperature = recorded_temperature(temperature, greedy)
        cursors = [Cursor(trie) for trie in tries]
        seqs = [list(p) + c.new for p, c in zip(prompts, cursors)]
        while not all(c.done for c in cursors):
            live = [r for r, c in enumerate(cursors) if not c.done]
            width = max(len(seqs[r]) for r in live)
            ids = torch.full((len(live), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(live):
                ids[i, width - len(seqs[r]):] = torch.tensor(seqs[r])
                mask[i, width - len(seqs[r]):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            hidden, _ = self.policy.hidden(ids, mask, positions)  # no cache; no vocabulary logits
            choose(self.policy, hidden[:, -1], [cursors[r] for r in live], temperature, greedy,
                   None if greedy else [rngs[r] for r in live], 0.0 if greedy else explore)
            for r in live:
                seqs[r] += cursors[r].new
        return [c.action(temperature) for c in cursors]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--env", "--difficulty", dest="env", default="easy", choices=env_options())
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per decoder, alternating (each: every env plays one episode)")
    ap.add_argument("--groups", type=int, default=None,
                    help="decode the envs as this many groups, both decoders (default: training's on a CPU)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--precision", default="auto", choices=["auto", "32-true", "bf16-mixed"],
                    help="auto: the faster of bf16 autocast and fp32 on this CPU, as training's memory=auto decides")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/rollout.json")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    env = load_env_config(args.env)
    policy, tokenizer = build_policy(load_model_config(args.model))
    policy.eval()
    precision = resolve_precision(args.precision, policy, "cpu")  # auto: as training decides it
    games = GamePool(GameSpec.from_env(env)).games("eval", args.envs)
    groups = args.groups or default_decode_groups(args.envs, cuda=False)
    # both play as training's rollouts do (play_games): env's prompt, the run's autocast, frozen
    # weights cast once per rollout; only the decoders differ
    decoders = {"cached": [ConstrainedDecoder(policy, drop_cut_turns=env.drop_turns_from_cache) for _ in range(groups)],
                "naive": [NaiveDecoder(policy, tokenizer.pad_token_id) for _ in range(groups)]}
    players = {name: Player(policy, tokenizer, d, autocast=lambda: autocast_context(precision, "cpu"))
               for name, d in decoders.items()}
    rounds = {name: [] for name in players}
    for k in range(args.rounds):
        for name, player in players.items():  # same games and seeds (round k) for both decoders
            sampling = Sampling(args.temperature, episode_seeds(args.seed, k, games))
            _, stats = play_games(player, games, env, sampling)
            row = {"seconds": round(stats.seconds, 2), "decisions": stats.decisions, "turns": stats.turns,
                   "decisions_per_s": stats.decisions_per_s, "env_s": round(stats.env_s, 2)}
            if stats.decode is not None:  # the cached decoder's profile: tokens fed, model time
                d = stats.decode
                row.update(tokens=d.tokens, model_calls=d.calls,
                           tokens_per_model_s=d.tokens / max(d.prefill_s + d.fork_s, 1e-9))
            rounds[name].append(row)
            print(name, k, row, flush=True)
    summary = {}
    for name, rows in rounds.items():
        rates = [r["decisions_per_s"] for r in rows]
        summary[name] = {"median_decisions_per_s": statistics.median(rates), "range": [min(rates), max(rates)]}
    # the same games and seeds make the decisions of both decoders the same in fp32 (bf16 may round a
    # close draw the other way): per-round ratios are comparable
    ratios = [c["decisions_per_s"] / n["decisions_per_s"] for c, n in zip(rounds["cached"], rounds["naive"])]
    out = {
        "decisions_per_s": summary["cached"]["median_decisions_per_s"],
        "naive_decisions_per_s": summary["naive"]["median_decisions_per_s"],
        "speedup_vs_naive": summary["cached"]["median_decisions_per_s"] / summary["naive"]["median_decisions_per_s"],
        "speedup_per_round": {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)], "values": ratios},
        "summary": summary,
        "model": args.model,
        "envs": args.envs,
        "groups": groups,
        "env": args.env,
        "rounds": args.rounds,
        "temperature": args.temperature,
        "precision": precision,
        "cpu_native_bf16": native_bf16(False),
        "torch": torch.__version__,
        "detail": rounds,
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
    }
    write_result(args.out, out, argv, show={k: out[k] for k in ("decisions_per_s", "naive_decisions_per_s",
                                                                "speedup_vs_naive", "speedup_per_round")})


if __name__ == "__main__":
    main()

"""Decisions per second of the rollout loop: this decoder vs. the seed's naive decoder.

The naive decoder is the seed's method: at every decision it re-pads and re-encodes the whole
prompt plus the partial command for all environments still choosing, with no KV cache, taking the
full-vocabulary logits of every position. Both decoders play the same games from the same seed;
only the decoder differs.

    python bench/rollout.py                      # model=smollm2, 16 easy environments
"""

from __future__ import annotations

import argparse
import platform

import torch

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import env_options, load_env_config, load_model_config
from textrl.games.env import TextGame
from textrl.games.pool import GamePool, GameSpec
from textrl.games.prompt import PromptBuilder
from textrl.policy.decoding import ConstrainedDecoder, Cursor, check_temperature, choose
from textrl.policy.model import PolicyValueModel, build_policy
from textrl.rollout import episode_seeds, play


class NaiveDecoder:
    """Re-encodes everything for every decision token (the seed's decoder), same sampling rule."""

    def __init__(self, policy: PolicyValueModel, pad_id: int):
        self.policy = policy
        self.pad_id = pad_id

    def reset(self) -> None:
        pass

    @torch.no_grad()
    def act(self, slots, prompts, tries, temperature=1.0, greedy=False, rngs=None):
        temperature = check_temperature(temperature, greedy)
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
            out = self.policy.lm(input_ids=ids, attention_mask=mask, position_ids=positions,
                                 output_hidden_states=True, logits_to_keep=0)  # all positions, as the seed
            choose(self.policy, out.hidden_states[-1][:, -1], [cursors[r] for r in live], temperature, greedy,
                   None if greedy else [rngs[r] for r in live])
            for r in live:
                seqs[r] += cursors[r].new
        return [c.action(temperature) for c in cursors]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--env", "--difficulty", dest="env", default="easy", choices=env_options())
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="rollouts per decoder (each: every env plays one episode)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/rollout.json")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    env = load_env_config(args.env)
    policy, tokenizer = build_policy(load_model_config(args.model))
    policy.eval()
    prompts = PromptBuilder(tokenizer, max_prompt_tokens=2048)
    games = GamePool(GameSpec.from_env(env)).games("eval", args.envs)
    results = {}
    for name, decoder in [("cached", ConstrainedDecoder(policy, tokenizer.pad_token_id)),
                          ("naive", NaiveDecoder(policy, tokenizer.pad_token_id))]:
        seconds = decisions = turns = 0
        for k in range(args.rounds):
            envs = [TextGame(g, env.max_steps) for g in games]
            _, stats = play(envs, decoder, prompts, temperature=args.temperature,
                            seeds=episode_seeds(args.seed, k, games))
            seconds += stats.seconds
            decisions += stats.decisions
            turns += stats.turns
        results[name] = {"seconds": seconds, "decisions": decisions, "turns": turns, "decisions_per_s": decisions / seconds}
        print(name, results[name], flush=True)
    out = {
        "decisions_per_s": results["cached"]["decisions_per_s"],
        "naive_decisions_per_s": results["naive"]["decisions_per_s"],
        "speedup_vs_naive": results["cached"]["decisions_per_s"] / results["naive"]["decisions_per_s"],
        "model": args.model,
        "envs": args.envs,
        "difficulty": args.env,
        "rounds": args.rounds,
        "temperature": args.temperature,
        "detail": results,
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
    }
    write_result(args.out, out, argv)


if __name__ == "__main__":
    main()

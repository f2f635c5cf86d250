"""bf16 attention on this CPU: torch's fused SDPA kernel against ``textrl.policy.speed.cpu_attention``'s
matrix products, per block shape and in a whole rollout.

Blocks: ``m`` queries over ``n`` keys, bottom-right causal, SmolLM2-135M's heads (9 query heads
sharing 3 key/value heads, 64 dims): a turn's prompt over a row's cache (m in the hundreds, n up to
~2,000 on medium), a decoding step (m = 1), the update's stream blocks (forward and backward).
Best of ``--repeats`` rounds each, in bf16 and fp32, with each one's largest deviation from an fp32
computation of the same block (the products round the scores to bf16).

``--rollout``: one rollout of 16 games of ``--env`` by the untrained SmolLM2 under the run's bf16
autocast, with the cut turns dropped from the cache (``env.drop_turns_from_cache=true``), played
once with each kernel forced, in ``--rounds`` alternating rounds (same games and seeds; the
decisions may differ where bf16 rounds a close draw the other way).

    python bench/attention_kernels.py --rollout      # writes bench/results/attention_kernels.json
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.nn import functional as F

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.policy.speed import cpu_attention
from textrl.policy.speed.cpu_attention import matmul_attention

SHAPES = [(1, 1300), (2, 1300), (30, 1300), (128, 1024), (170, 1300), (170, 2000), (170, 300), (400, 1300),
          (600, 600)]


def best_ms(run, repeats: int) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def kernels(repeats: int) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for m, n in SHAPES:
        q = torch.randn(1, 9, m, 64, generator=gen) * 2
        k, v = torch.randn(1, 3, n, 64, generator=gen) * 2, torch.randn(1, 3, n, 64, generator=gen)
        mask = None if m == 1 else torch.ones(m, n, dtype=torch.bool).tril(n - m)
        with torch.no_grad():
            reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        for dtype in (torch.bfloat16, torch.float32):
            args = [t.to(dtype) for t in (q, k, v)]
            fused = lambda: F.scaled_dot_product_attention(*args, attn_mask=mask, enable_gqa=True)  # noqa: E731
            products = lambda: matmul_attention(*args, None)  # noqa: E731
            row = {"queries": m, "keys": n, "dtype": str(dtype).removeprefix("torch.")}
            with torch.no_grad():
                row["fused_ms"], row["products_ms"] = best_ms(fused, repeats), best_ms(products, repeats)
                row["fused_max_error"] = (fused().float() - reference).abs().max().item()
                row["products_max_error"] = (products().float() - reference).abs().max().item()
            if m > 1:  # the update's blocks: forward and backward
                grads = [t.detach().requires_grad_() for t in args]
                g = torch.randn(1, 9, m, 64, generator=gen).to(dtype)
                row["fused_fwd_bwd_ms"] = best_ms(lambda: F.scaled_dot_product_attention(
                    *grads, attn_mask=mask, enable_gqa=True).backward(g), max(1, repeats // 2))
                row["products_fwd_bwd_ms"] = best_ms(lambda: matmul_attention(*grads, None).backward(g),
                                                     max(1, repeats // 2))
            row["products_vs_fused"] = row["products_ms"] / row["fused_ms"]
            rows.append(row)
            print(row, flush=True)
    return rows


def rollouts(env_name: str, rounds: int) -> dict:
    from textrl.config import default_decode_groups, load_env_config, load_model_config
    from textrl.games.pool import GamePool, GameSpec
    from textrl.policy.decoding import ConstrainedDecoder
    from textrl.policy.model import build_policy
    from textrl.rollout import Player, Sampling, episode_seeds, play_games

    torch.manual_seed(0)
    env = dataclasses.replace(load_env_config(env_name), drop_turns_from_cache=True)
    policy, tokenizer = build_policy(load_model_config("smollm2"))
    policy.eval()
    games = GamePool(GameSpec.from_env(env)).games("eval", 16)
    decoders = [ConstrainedDecoder(policy, drop_cut_turns=True) for _ in range(default_decode_groups(16, cuda=False))]
    player = Player(policy, tokenizer, decoders, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    measured = cpu_attention.matmul_is_faster
    runs = {"fused": [], "products": []}
    try:
        for k in range(rounds):
            order = ["fused", "products"] if k % 2 == 0 else ["products", "fused"]
            for name in order:
                cpu_attention.matmul_is_faster = lambda name=name: name == "products"  # forced, this process only
                start = time.perf_counter()
                _, stats = play_games(player, games, env, Sampling(1.0, episode_seeds(0, 0, games)))
                row = {"round": k + 1, "seconds": round(time.perf_counter() - start, 2), "tokens": stats.decode.tokens,
                       "decisions": stats.decisions, "model_s": round(stats.decode.prefill_s + stats.decode.fork_s, 2)}
                runs[name].append(row)
                print(name, row, flush=True)
    finally:
        cpu_attention.matmul_is_faster = measured
    fused, products = (statistics.median(r["seconds"] for r in runs[n]) for n in ("fused", "products"))
    return {"env": env_name, "envs": 16, "rounds": rounds, "runs": runs, "fused_s_median": fused,
            "products_s_median": products, "products_vs_fused": products / fused}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10, help="timed rounds of each block (best kept)")
    ap.add_argument("--rollout", action="store_true", help="also time a whole rollout with each kernel")
    ap.add_argument("--env", default="medium")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rollout rounds (each kernel once a round)")
    ap.add_argument("--out", default="bench/results/attention_kernels.json")
    args = ap.parse_args(argv)
    out = {"blocks": kernels(args.repeats), "decision_measured_here": cpu_attention.matmul_is_faster()}
    if args.rollout:
        out["rollout"] = rollouts(args.env, args.rounds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                            capture_output=True, text=True).stdout.strip()
    out.update(textrl_commit=commit, torch=torch.__version__, torch_threads=torch.get_num_threads(),
               machine=platform.processor() or platform.machine(), precision="bf16 (forced; fp32 rows too)")
    show = {"decision_measured_here": out["decision_measured_here"]}
    if args.rollout:
        show["rollout_products_vs_fused"] = out["rollout"]["products_vs_fused"]
    write_result(args.out, out, argv, show=show)


if __name__ == "__main__":
    main()

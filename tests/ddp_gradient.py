"""``python tests/ddp_gradient.py OUT_JSON``: the PPO update's gradient over 4 real episodes in one
process, and over the same episodes split 3 / 1 across two gloo ranks, run by tests/test_ddp.py.

The ranks' ``Runtime`` does what DDP does to gradients: each backward outside ``no_sync``
all-reduces the accumulated gradients and divides them by the world size. One optimizer step
covers every sequence (``ppo.grad_accum`` larger than any rank's count); its gradient is recorded
instead of applied. Writes the largest difference between the two, and the gradient's largest entry.
"""

import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from textrl.games.pool import GamePool  # noqa: E402
from textrl.policy.decoding import ConstrainedDecoder  # noqa: E402
from textrl.policy.memory import make_optimizer  # noqa: E402
from textrl.policy.model import build_policy  # noqa: E402
from textrl.ppo.update import PPOUpdate, Runtime  # noqa: E402
from textrl.rollout import Player, Sampling, episode_seeds, play_games  # noqa: E402
from tests.conftest import config  # noqa: E402

SPLIT = 3  # rank 0's episodes of the 4; rank 1 has the rest


def gradient(out_dir: str, rank: int | None) -> dict[str, torch.Tensor]:
    cfg = config(Path(out_dir), "env.max_steps=4", "ppo.epochs=1", "ppo.minibatch_size=1", "ppo.grad_accum=64",
                 "ppo.normalize_advantages=false",  # whitening is per rank: a different target
                 "ppo.max_grad_norm=1e9")
    torch.manual_seed(0)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy, batched=False)])
    games = GamePool("easy").games("train", 4)
    episodes, _ = play_games(player, games, cfg.env, Sampling(1.0, episode_seeds(0, 0, games)))
    runtime = Runtime()
    if rank is not None:
        episodes = episodes[:SPLIT] if rank == 0 else episodes[SPLIT:]
        syncing = [True]

        @contextlib.contextmanager
        def no_sync():
            syncing[0] = False
            yield
            syncing[0] = True

        def backward(loss):
            loss.backward()
            if syncing[0]:  # DDP: the step's last backward averages the accumulated gradients
                for q in policy.parameters():
                    if q.grad is not None:
                        dist.all_reduce(q.grad)
                        q.grad /= dist.get_world_size()

        def all_reduce(tensor, op):
            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
            return tensor

        runtime = Runtime(backward=backward, all_reduce=all_reduce, world_size=dist.get_world_size, no_sync=no_sync)
    update = PPOUpdate(policy, cfg.ppo, tokenizer.pad_token_id, cfg.seed, runtime=runtime)
    optimizer = make_optimizer([q for q in policy.lm.parameters() if q.requires_grad],
                               list(policy.value_head.parameters()), cfg.memory, 1e-3, 1e-3, 0.0)
    grads = {}

    def record(*a, **k):
        assert not grads, "one optimizer step expected"
        grads.update({n: q.grad.clone() for n, q in policy.named_parameters() if q.grad is not None})

    optimizer.step = record
    policy.train()
    update.run(episodes, 0, optimizer)
    return grads


def rank_main(rank: int, init: str, out_dir: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    grads = gradient(out_dir, rank)
    if rank == 0:
        torch.save(grads, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    out = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        single = gradient(tmp, None)
        mp.spawn(rank_main, args=(f"file://{tmp}/init", tmp, f"{tmp}/ddp.pt"), nprocs=2)
        ddp = torch.load(f"{tmp}/ddp.pt")
    out.write_text(json.dumps({
        "names": sorted(single) == sorted(ddp),
        "max_abs_diff": max(float((single[n] - ddp[n]).abs().max()) for n in single),
        "max_abs": max(float(g.abs().max()) for g in single.values()),
    }))

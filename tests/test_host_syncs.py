"""Host-device synchronisations of a real rollout and a real update, counted on the CPU as they
would happen on a GPU (``tests/host_syncs.py``), against the budget docs/gpu.md states: per model
call of the rollout one copy to the device and at most one read back; per minibatch of the update
one copy to the device, per optimizer step one read (its gradient norms), and a fixed few per
iteration. Each extra read makes the host wait for the GPU to drain its queue."""

import pytest
import torch

from tests.conftest import config
from tests.host_syncs import HostSyncs
from textrl.config import register_configs
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.memory import make_optimizer
from textrl.policy.model import build_policy
from textrl.policy.reference import ReferencePolicy
from textrl.ppo.update import PPOUpdate
from textrl.rollout import Player, Sampling, episode_seeds, play_games

register_configs()
PER_ITERATION = 6  # rollout records and targets to the device, old values and metrics back, weight check, norms stack


def rollout(cfg, games, batched):
    torch.manual_seed(0)
    policy, tokenizer = build_policy(cfg.model, cfg.env.step_penalty)
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy, batched=batched) for _ in range(2)])
    with HostSyncs(policy) as syncs:
        episodes, stats = play_games(player, games, cfg.env, Sampling(1.0, episode_seeds(0, 0, games)))
    return policy, tokenizer, episodes, stats, syncs


@pytest.mark.parametrize("batched", [False, True], ids=["cpu_layout", "gpu_layout"])
def test_a_rollout_copies_once_per_model_call_and_reads_once_per_fork_level(tmp_path, easy_pool, batched):
    cfg = config(tmp_path, "env.max_steps=4")
    _, _, episodes, stats, syncs = rollout(cfg, easy_pool.games("train", 4), batched)
    calls = stats.decode.calls
    assert calls > 8 and sum(e.length for e in episodes) >= 8
    assert syncs.counts["to_device"] == calls, syncs.where  # one buffer per call
    assert syncs.counts["to_host"] <= calls, syncs.where  # the fork's table (values, entropies, log-probs)
    assert syncs.counts["list_index"] == 0, syncs.where


@pytest.mark.parametrize("overrides", [[], ["ppo.recompute_old=true", "ppo.kl_coef=0.1"], ["ppo.target_kl=1000"]],
                         ids=["plain", "recompute_kl", "target_kl"])
def test_an_update_copies_once_per_minibatch_and_reads_once_per_optimizer_step(tmp_path, easy_pool, overrides):
    cfg = config(tmp_path, "env.max_steps=4", *overrides)
    policy, tokenizer, episodes, _, _ = rollout(cfg, easy_pool.games("train", 4), False)
    update = PPOUpdate(policy, cfg.ppo, tokenizer.pad_token_id, cfg.seed,
                       reference=ReferencePolicy(policy.lm, False) if cfg.ppo.kl_coef else None)
    optimizer = make_optimizer([q for q in policy.lm.parameters() if q.requires_grad],
                               list(policy.value_head.parameters()), cfg.memory, 1e-4, 1e-3, 0.0)
    steps = update.prepare(episodes, 0).steps
    minibatches = sum(len(step) for step in steps)
    first_pass = sum(len(step) for step in steps[: len(steps) // cfg.ppo.epochs])
    extra = first_pass * ((cfg.ppo.recompute_old is True) + (cfg.ppo.kl_coef > 0))  # one copy per forward
    policy.train()
    with HostSyncs(policy) as syncs:
        update.run(episodes, 0, optimizer).metrics()
    assert minibatches >= 4 and len(steps) >= 2
    assert syncs.counts["to_device"] <= minibatches + extra + 2, syncs.where
    assert syncs.counts["to_host"] <= len(steps) + 4, syncs.where
    assert syncs.counts["list_index"] == 0, syncs.where
    assert syncs.total <= minibatches + extra + len(steps) + PER_ITERATION


def test_the_counter_sees_what_synchronises(tiny):
    """The instrument itself: reads of device values and copies of host data are counted; work
    that stays on the device, and host tensors read on the host, are not."""
    policy, _ = tiny
    weight = next(policy.parameters())
    with HostSyncs(policy) as syncs, torch.no_grad():
        on_device = weight * 2 + torch.arange(weight.shape[-1], device=weight.device)
        float(on_device.sum())  # read: 1
        on_device[[0, 1]]  # a Python list as an index: 1
        torch.tensor([1, 2], device=weight.device)  # host data copied: 1
        host = on_device.cpu()  # read: 1
        float(host.sum()), torch.tensor([3.0]).item()  # host values: 0
    assert dict(syncs.counts) == {"to_host": 2, "list_index": 1, "to_device": 1}

"""Rollouts as a Lightning DataModule.

``RolloutDataset.__iter__`` runs once per epoch (= PPO iteration): it plays one episode in each of
``env.num_envs`` training games with the current policy, turns the episodes into sequences with
GAE advantages, and yields shuffled minibatches for ``ppo.epochs`` passes. The validation loader
yields the fixed held-out evaluation games in batches.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from textrl.config import TrainConfig
from textrl.games.pool import GamePool
from textrl.ppo.buffer import Sequence, build_sequences, minibatches
from textrl.ppo.losses import correlation, explained_variance
from textrl.rollout import episode_metrics


@dataclass
class Minibatch:
    sequences: list[Sequence]
    first: bool  # first minibatch of the iteration (weights not yet updated)
    last: bool  # last one: flush accumulated gradients


def _as_is(item):
    return item


def iteration_rng(seed: int, iteration: int) -> random.Random:
    """Game order and minibatch order depend only on (seed, iteration): a resumed run repeats them."""
    return random.Random(seed * 1_000_003 + iteration)


class RolloutDataset(IterableDataset):
    def __init__(self, datamodule: "RolloutDataModule"):
        self.dm = datamodule

    def __iter__(self):
        dm = self.dm
        module = dm.trainer.lightning_module
        cfg = dm.cfg
        iteration = module.current_epoch
        start = time.perf_counter()
        episodes = module.play(dm.games_for_iteration(iteration), greedy=False)
        rollout_s = time.perf_counter() - start
        sequences = build_sequences(episodes, cfg.ppo.gamma, cfg.ppo.lam, cfg.ppo.normalize_advantages)
        values = torch.tensor([v for s in sequences for v in s.old_values])
        returns = torch.tensor([r for s in sequences for r in s.returns])
        stats = module._last_play
        module.rollout_episodes = float(len(episodes))
        module.rollout_metrics = {
            **episode_metrics(episodes, "rollout"),
            "rollout/decisions_per_s": stats.decisions_per_s,
            "rollout/decisions": float(stats.decisions),
            "perf/rollout_s": rollout_s,
            "value/explained_variance": explained_variance(values, returns),
            "value/corr": correlation(values, returns),
        }
        sequences = dm.equalize_across_ranks(sequences)
        batches = list(minibatches(sequences, cfg.ppo.minibatch_size, cfg.ppo.epochs, iteration_rng(cfg.seed, iteration)))
        for i, batch in enumerate(batches):
            yield Minibatch(batch, first=i == 0, last=i == len(batches) - 1)


class RolloutDataModule(L.LightningDataModule):
    def __init__(self, cfg: TrainConfig):
        super().__init__()
        self.cfg = cfg
        self.train_games: list[Path] = []
        self.eval_games: list[Path] = []

    def prepare_data(self):
        self._pool_games()  # generate once, on one process; setup() then only reads the cache

    def _pool_games(self):
        e = self.cfg.env
        pool = GamePool(e.difficulty, cache_dir=self.cfg.cache_dir, workers=e.workers)
        n_train = e.num_envs if e.repeatable else e.pool_size
        return pool.games("train", n_train), pool.games("eval", self.cfg.eval.games)

    def setup(self, stage: str):
        if not self.train_games:
            self.train_games, self.eval_games = self._pool_games()

    @property
    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def games_for_iteration(self, iteration: int) -> list[Path]:
        """This rank's share of the iteration's ``env.num_envs`` training games."""
        n = self.cfg.env.num_envs
        games = self.train_games[:n] if self.cfg.env.repeatable else \
            iteration_rng(self.cfg.seed, iteration).sample(self.train_games, n)
        rank, world = self._rank_world
        return games[rank::world]

    def equalize_across_ranks(self, sequences: list[Sequence]) -> list[Sequence]:
        """DDP needs the same number of backward passes on every rank: a rank with fewer sequences
        repeats some of its own (in order) up to the largest count."""
        rank, world = self._rank_world
        if world == 1 or not sequences:
            return sequences
        import torch.distributed as dist

        count = torch.tensor(len(sequences), device=self.trainer.strategy.root_device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return [sequences[i % len(sequences)] for i in range(int(count))]

    def train_dataloader(self):
        return DataLoader(RolloutDataset(self), batch_size=None, collate_fn=_as_is)

    def val_dataloader(self):
        rank, world = self._rank_world
        games = self.eval_games[rank::world]  # ranks split the evaluation games without overlap
        b = self.cfg.eval.batch
        chunks = [games[i: i + b] for i in range(0, len(games), b)]
        return DataLoader(chunks, batch_size=None, collate_fn=_as_is)

"""The games each PPO iteration plays, as a Lightning DataModule.

``games_for_iteration(k)`` is this rank's share of iteration k's ``env.num_envs`` training games;
``PPOModule.training_step`` asks for it and runs the whole PPO iteration (rollout, advantages,
update). The training loader only paces Lightning: one item per epoch, so one training step per
iteration. (It cannot carry the games: Lightning fetches the first item before it settles the
epoch number when it resumes from a checkpoint written at the end of an epoch.) The validation
loader yields the fixed held-out evaluation games in batches.
"""

from __future__ import annotations

import random
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from textrl.config import TrainConfig
from textrl.games.pool import GamePool, GameSpec


def _as_is(item):
    return item


def iteration_rng(seed: int, iteration: int) -> random.Random:
    """Game order and minibatch order depend only on (seed, iteration): a resumed run repeats them."""
    return random.Random(seed * 1_000_003 + iteration)


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
        pool = GamePool(GameSpec.from_env(e), cache_dir=self.cfg.cache_dir, workers=e.workers)
        n_train = e.num_envs // e.group_size if e.repeatable else e.pool_size
        return pool.games("train", n_train), pool.games("eval", self.cfg.eval.games)

    def setup(self, stage: str):
        if not self.train_games:
            self.train_games, self.eval_games = self._pool_games()

    @property
    def _rank_world(self) -> tuple[int, int]:
        trainer = self.trainer
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def games_for_iteration(self, iteration: int) -> list[Path]:
        """This rank's share of the iteration's ``env.num_envs`` episodes: ``num_envs / group_size``
        games, each listed ``group_size`` times in a row. A game's group stays on one rank, so the
        group baselines (ppo.advantage=grpo|rloo) see all of its episodes."""
        e = self.cfg.env
        n = e.num_envs // e.group_size
        games = self.train_games[:n] if e.repeatable else iteration_rng(self.cfg.seed, iteration).sample(self.train_games, n)
        rank, world = self._rank_world
        return [g for g in games[rank::world] for _ in range(e.group_size)]

    def train_dataloader(self):
        # one item (not None: Lightning skips a step whose batch is None), one training step per epoch
        return DataLoader(["iteration"], batch_size=None, collate_fn=_as_is)

    def val_dataloader(self):
        """The held-out evaluation games and, second, ``eval.train_games`` fixed training games."""
        rank, world = self._rank_world
        b = self.cfg.eval.batch
        loaders = []
        for games in (self.eval_games, self.train_games[: self.cfg.eval.train_games]):
            games = games[rank::world]  # ranks split the games without overlap
            if games:
                loaders.append(DataLoader([games[i: i + b] for i in range(0, len(games), b)], batch_size=None,
                                          collate_fn=_as_is))
        return loaders

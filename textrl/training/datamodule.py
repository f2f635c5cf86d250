"""The run's games served to Lightning: one PPO iteration per epoch, then the evaluation games.

The training loader paces Lightning: one item per epoch, the run's ``Curriculum``, from which
``PPOModule.training_step`` takes the iteration's games and to which it reports their outcome. (The
item cannot be the games themselves: when Lightning resumes from a checkpoint written at the end of
an epoch, it fetches the first item before it settles the epoch number.) The validation loaders
yield, when each evaluation starts, the held-out evaluation games and ``eval.train_games`` fixed
training games of the current stage, in batches of (games, the env config they are played with).
"""

from __future__ import annotations

from typing import Callable

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from textrl.config import TrainConfig
from textrl.training.curriculum import Curriculum


def _as_is(item):
    return item


class _Batches(IterableDataset):
    """Batches computed when a loop starts iterating, not when the loader is built: the fixed
    training games follow the curriculum's stage."""

    def __init__(self, batches: Callable[[], list]):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches())


class RolloutDataModule(L.LightningDataModule):
    def __init__(self, cfg: TrainConfig, position_limit: int | None = None, games_made: bool = False):
        super().__init__()
        self.cfg = cfg
        self.curriculum = Curriculum(cfg, position_limit)  # its stages' prompts within the policy's positions
        self.games_made = games_made  # by the caller (``generate_games``): prepare_data only reads the cache
        self.prepared = False

    @property
    def eval_games(self):
        return self.curriculum.eval_games

    def prepare_data(self):
        """Every game the run can play, generated or found in the cache (``train`` generates them
        before anything touches CUDA: Lightning's calls, fit and validate, then find them there)."""
        if not self.prepared:
            if self.games_made:
                self.curriculum.load()
            else:
                self.curriculum.generate()  # setup() only reads the cache
            self.prepared = True

    def setup(self, stage: str):
        if not self.curriculum.train_games:
            self.curriculum.load()

    def state_dict(self) -> dict:
        return self.curriculum.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.curriculum.load_state_dict(state)

    def train_dataloader(self):
        return DataLoader([self.curriculum], batch_size=None, collate_fn=_as_is)

    def val_dataloader(self):
        """The held-out evaluation games and, second, ``eval.train_games`` fixed training games."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        b = self.cfg.eval.batch
        c = self.curriculum

        def batches(games, env):
            games = games[rank::world]  # ranks split the games without overlap
            return [(games[i: i + b], env) for i in range(0, len(games), b)]

        # the same loaders on every rank, also on one whose share is empty: a rank with fewer loaders
        # would run fewer of Lightning's collectives and hang the others (on_validation_epoch_end
        # still runs on it, and joins the evaluation's reductions)
        loaders = [(c.eval_games, lambda: batches(c.eval_games, self.cfg.env))]
        if self.cfg.eval.train_games:
            loaders.append((c.train_games, lambda: batches(c.train_games[: self.cfg.eval.train_games], c.env)))
        return [DataLoader(_Batches(f), batch_size=None, collate_fn=_as_is) for games, f in loaders if games]

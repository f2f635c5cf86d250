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

from textrl.config import EnvConfig, TrainConfig, load_env_config
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
        # the curriculum (cfg.curriculum): its stage (cfg.curriculum.stages), the stage's per-iteration
        # training win rates and its recently lost games (replayed with or without stages); saved in
        # checkpoints (state_dict), so a resumed run continues at the same stage with the same replays
        self.stage = 0
        self.stage_win_rates: list[float] = []
        self.lost: list[str] = []
        self.replayed = 0  # how many of the last games_for_iteration's games were replays

    @property
    def train_env(self) -> EnvConfig:
        """The env config training rollouts play: ``env``, or the curriculum stage's games shown with
        ``env``'s prompt settings."""
        stages = self.cfg.curriculum.stages
        return load_env_config(stages[self.stage]).with_prompt_of(self.cfg.env) if stages else self.cfg.env

    def _train_pool(self, env: EnvConfig) -> list[Path]:
        e = self.cfg.env
        n_train = e.num_envs // e.group_size if e.repeatable else e.pool_size
        return GamePool(GameSpec.from_env(env), cache_dir=self.cfg.cache_dir, workers=e.workers).games("train", n_train)

    def prepare_data(self):
        # generate once, on one process (every curriculum stage's games too); setup() only reads the cache
        for stage in self.cfg.curriculum.stages:
            self._train_pool(load_env_config(stage))
        self._pool_games()

    def _pool_games(self):
        e = self.cfg.env
        pool = GamePool(GameSpec.from_env(e), cache_dir=self.cfg.cache_dir, workers=e.workers)
        return self._train_pool(self.train_env), pool.games("eval", self.cfg.eval.games)

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
        group baselines (ppo.advantage=grpo|rloo) see all of its episodes. A ``curriculum.replay`` share
        of the games are recently lost ones (of the curriculum's stage, if there is one)."""
        e = self.cfg.env
        n = e.num_envs // e.group_size
        rng = iteration_rng(self.cfg.seed, iteration)
        if e.repeatable:
            games = self.train_games[:n]
        else:
            replayed = [Path(g) for g in rng.sample(self.lost, min(len(self.lost), round(self.cfg.curriculum.replay * n)))]
            fresh = [g for g in self.train_games if g not in replayed]
            games = replayed + rng.sample(fresh, n - len(replayed))
            self.replayed = len(replayed)
        rank, world = self._rank_world
        return [g for g in games[rank::world] for _ in range(e.group_size)]

    @property
    def stage_win_rate(self) -> float | None:
        """The mean of the stage's last ``curriculum.window`` training win rates (None right after a move)."""
        recent = self.stage_win_rates[-self.cfg.curriculum.window:]
        return sum(recent) / len(recent) if recent else None

    def record(self, win_rate: float, lost: list[str]) -> bool:
        """An iteration's training win rate (over all ranks) and this rank's lost games (remembered for
        replays); moves to the next curriculum stage when the stage's last ``curriculum.window`` win
        rates average at least ``curriculum.threshold``. Returns whether it moved."""
        c = self.cfg.curriculum
        lost = list(dict.fromkeys(lost))  # a game of a group (env.group_size) may be lost several times
        self.lost = [g for g in self.lost if g not in set(lost)] + lost
        del self.lost[: max(0, len(self.lost) - c.replay_size)]
        if not c.stages:
            return False
        self.stage_win_rates.append(win_rate)
        full = len(self.stage_win_rates) >= c.window
        if self.stage + 1 < len(c.stages) and full and self.stage_win_rate >= c.threshold:
            self.stage += 1
            self.stage_win_rates, self.lost = [], []
            self.train_games = self._train_pool(self.train_env)
            return True
        return False

    def state_dict(self) -> dict:
        return {"stage": self.stage, "stage_win_rates": self.stage_win_rates, "lost": self.lost}

    def load_state_dict(self, state: dict) -> None:
        self.stage, self.stage_win_rates, self.lost = state["stage"], state["stage_win_rates"], state["lost"]
        if self.cfg.curriculum.stages:
            self.train_games = self._train_pool(self.train_env)

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

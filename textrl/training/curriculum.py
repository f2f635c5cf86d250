"""Which training games each PPO iteration plays: fresh games, replays of recently lost ones, and
the curriculum's stages, which move on as the policy masters them.

Game order depends only on (seed, iteration) and the curriculum's state (its stage, the stage's win
rates, the recently lost games), which checkpoints keep: a resumed run plays the games the
uninterrupted run would have played.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from textrl.config import EnvConfig, TrainConfig, fit_to_positions, load_env_config, training_game_count
from textrl.games.pool import GamePool, GameSpec
from textrl.rollout import iteration_rng


@dataclass(frozen=True)
class IterationGames:
    games: list[Path]  # this rank's share, each game listed env.group_size times in a row
    env: EnvConfig  # the settings they are played with: env, or the stage's shown with env's prompt
    stage: int  # the curriculum stage they belong to
    replayed: int  # how many of the iteration's games (all ranks) are recently lost ones
    every_rank: list[Path]  # the iteration's games on all ranks, in order, each once


def stage_envs(cfg: TrainConfig, position_limit: int | None = None) -> list[EnvConfig]:
    """Each curriculum stage's games shown with env's prompt settings, and its own prompt budget
    (hard's: 2048) within the policy's ``position_limit`` as ``resolve`` fits env's (one log line per
    stage capped)."""
    return [fit_to_positions(load_env_config(s).with_prompt_of(cfg.env), position_limit, cfg.model.name)
            for s in cfg.curriculum.stages]


def generate_games(cfg: TrainConfig) -> None:
    """Generate (or find in the cache) every game the run can play: env's and every stage's training
    games, the warm start's (env's first ``warm_start.games`` training games) and the evaluation
    games. ``train`` calls it before anything touches CUDA: no game is made mid-run."""
    e = cfg.env
    for stage in cfg.curriculum.stages:
        GamePool(GameSpec.from_env(load_env_config(stage)), cache_dir=cfg.cache_dir, workers=e.workers).games(
            "train", training_game_count(e))
    pool = GamePool(GameSpec.from_env(e), cache_dir=cfg.cache_dir, workers=e.workers)
    if cfg.warm_start.steps:
        pool.games("train", cfg.warm_start.games)
    if not cfg.curriculum.stages:
        pool.games("train", training_game_count(e))
    pool.games("eval", cfg.eval.games)


class Curriculum:
    """The training and evaluation games of a run, and the state that decides which training games
    an iteration plays (``curriculum`` config): the stage, the stage's per-iteration training win
    rates and its recently lost games (replayed with or without stages)."""

    def __init__(self, cfg: TrainConfig, position_limit: int | None = None):
        self.cfg = cfg
        self.stage = 0
        self.stage_win_rates: list[float] = []
        self.lost: list[str] = []
        self.train_games: list[Path] = []  # the current stage's training pool
        self.eval_games: list[Path] = []  # env's held-out games (evaluation never changes stage)
        self.stage_envs = stage_envs(cfg, position_limit)

    @property
    def env(self) -> EnvConfig:
        """The env config training rollouts play: ``env``, or the curriculum stage's games shown with
        ``env``'s prompt settings."""
        return self.stage_envs[self.stage] if self.stage_envs else self.cfg.env

    def _train_pool(self, env: EnvConfig) -> list[Path]:
        pool = GamePool(GameSpec.from_env(env), cache_dir=self.cfg.cache_dir, workers=self.cfg.env.workers)
        return pool.games("train", training_game_count(self.cfg.env))

    def generate(self) -> None:
        """Every game the run can play (``generate_games``), then the current stage's and the
        evaluation games read from the cache."""
        generate_games(self.cfg)
        self.load()

    def load(self) -> None:
        """Read the current stage's training games and the evaluation games from the cache."""
        e = self.cfg.env
        pool = GamePool(GameSpec.from_env(e), cache_dir=self.cfg.cache_dir, workers=e.workers)
        self.train_games, self.eval_games = self._train_pool(self.env), pool.games("eval", self.cfg.eval.games)

    def games(self, iteration: int, rank: int = 0, world: int = 1) -> IterationGames:
        """This rank's share of iteration ``iteration``'s ``env.num_envs`` episodes:
        ``num_envs / group_size`` games, each listed ``group_size`` times in a row. A game's group
        stays on one rank, so the group baselines (ppo.advantage=grpo|rloo|gigpo) see all of its episodes.
        A ``curriculum.replay`` share of the games are recently lost ones."""
        e = self.cfg.env
        n = e.num_envs // e.group_size
        rng = iteration_rng(self.cfg.seed, iteration)
        replayed: list[Path] = []
        if e.repeatable:
            games = self.train_games[:n]
        else:
            replayed = [Path(g) for g in rng.sample(self.lost, min(len(self.lost), round(self.cfg.curriculum.replay * n)))]
            fresh = [g for g in self.train_games if g not in replayed]
            games = replayed + rng.sample(fresh, n - len(replayed))
        mine = [g for g in games[rank::world] for _ in range(e.group_size)]
        return IterationGames(mine, self.env, self.stage, len(replayed), games)

    @property
    def stage_win_rate(self) -> float | None:
        """The mean of the stage's last ``curriculum.window`` training win rates (None right after a move)."""
        recent = self.stage_win_rates[-self.cfg.curriculum.window:]
        return sum(recent) / len(recent) if recent else None

    def record(self, win_rate: float, lost: list[str]) -> bool:
        """An iteration's training win rate and lost games, both over all ranks (the lost ones are
        remembered for replays: every rank keeps the same list, so all ranks draw the same replays and
        rank 0's checkpoint holds what each rank resumes with); moves to the next curriculum stage when the stage's last ``curriculum.window`` win
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
            self.train_games = self._train_pool(self.env)
            return True
        return False

    @property
    def needs_outcomes(self) -> bool:
        """Whether ``record`` needs the iteration's outcome: stages move on it, replays come from it."""
        return bool(self.cfg.curriculum.stages or self.cfg.curriculum.replay)

    def metrics(self, played: IterationGames) -> dict[str, float]:
        """``curriculum/*`` of an iteration that played ``played`` (after its ``record``)."""
        out = {}
        if self.cfg.curriculum.replay and not self.cfg.env.repeatable:
            out["curriculum/replayed"] = float(played.replayed)  # the iteration's games that were recently lost ones
        if self.cfg.curriculum.stages:
            out["curriculum/stage"] = float(played.stage)  # the stage this iteration played
            if self.stage_win_rate is not None:  # what the next move is decided on (none right after a move)
                out["curriculum/stage_win_rate"] = self.stage_win_rate
        return out

    def state_dict(self) -> dict:
        return {"stage": self.stage, "stage_win_rates": self.stage_win_rates, "lost": self.lost}

    def load_state_dict(self, state: dict) -> None:
        self.stage, self.stage_win_rates = state["stage"], state["stage_win_rates"]
        if self.cfg.curriculum.stages or not self.train_games:
            self.load()  # the stage's training games
        # only games of this run's own pool are replayed: a checkpoint names no files to open
        pool = {str(g) for g in self.train_games}
        self.lost = [g for g in state["lost"] if g in pool]

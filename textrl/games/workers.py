"""Games stepped in worker processes (``env.step_workers=W``), side by side.

A game step costs about 8 ms of Python (TextWorld's state tracking computes the admissible
commands). In the training process, 64 games step one after the other: half a second a turn,
longer than the model's decoding on a GPU. With W workers, each worker process holds a share of the
games (game ``i`` on worker ``i % W``) and one call per worker steps all of its games; the W calls
run at once, so a turn's stepping takes about 1/W of the time. The rollout also splits its
environments into two groups with a decoder each (``play_games``, ``run_episodes``): the steps
are sent without waiting (``step_games_async``), so one group's games step while the other group
decodes.

Each worker is a server process of the standard library's ``multiprocessing.managers`` (started
with ``spawn``: the training process holds torch's threads, which ``fork`` does not copy safely),
hosting a ``GameHost`` that opens, resets and steps the games it is given. In the training process
each game is a ``RemoteGame``: the same interface as ``Game`` (``reset``, ``step``, ``observation``,
``history``, ``walkthrough``, ``game_file``), its state mirrored from the worker's answers, so the
rollout loop, prompts and transcripts do not know where a game runs. ``step_games`` steps a batch,
``step_games_async`` sends it.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.managers import BaseManager
from pathlib import Path

from textrl.games.env import Game, Observation, StepResult, Turn, open_game


class GameHost:
    """Lives in a worker: the games it holds, by key."""

    def __init__(self):
        self.games: dict[int, Game] = {}

    def open(self, key: int, game_file: str, env) -> None:
        self.games[key] = open_game(game_file, env)

    def reset(self, keys: list[int]) -> list[tuple[Observation, list[str]]]:
        return [(self.games[k].reset(), self.games[k].walkthrough) for k in keys]

    def step(self, moves: list[tuple[int, str]]) -> list[tuple[StepResult, list[Turn]]]:
        out = []
        for key, command in moves:
            game = self.games[key]
            out.append((game.step(command), game.history))
        return out

    def close(self, keys: list[int]) -> None:
        for k in keys:
            self.games.pop(k).close()


class _Manager(BaseManager):
    pass


_Manager.register("GameHost", GameHost)


class RemoteGame:
    """A game held by a worker, seen from the training process as a ``Game``."""

    def __init__(self, workers: GameWorkers, worker: int, key: int, game_file: str | Path):
        self.workers, self.worker, self.key = workers, worker, key
        self.game_file = Path(game_file)
        self.observation: Observation | None = None
        self.history: list[Turn] = []
        self.walkthrough: list[str] = []

    def reset(self) -> Observation:
        return reset_games([self])[0]

    def step(self, command: str) -> StepResult:
        return step_games([self], [command])[0]

    def close(self) -> None:
        self.workers.hosts[self.worker].close([self.key])


class GameWorkers:
    """W worker processes that hold and step games; ``open`` places games on them."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError(f"step workers must be >= 1, got {n}")
        ctx = mp.get_context("spawn")
        self.managers = [_Manager(ctx=ctx) for _ in range(n)]
        for m in self.managers:
            m.start()
        self.hosts = [m.GameHost() for m in self.managers]
        # a call in flight per worker for each of two groups of games (run_episodes' overlap)
        self.threads = ThreadPoolExecutor(max_workers=2 * n)
        self.next_key = 0

    def open(self, game_files: list[str | Path], env) -> list[RemoteGame]:
        games = []
        for i, path in enumerate(game_files):
            games.append(RemoteGame(self, i % len(self.hosts), self.next_key, path))
            self.next_key += 1
        for _, call in self.each(games, lambda host, mine: [host.open(g.key, str(g.game_file), env) for g in mine]):
            call.result()
        return games

    def each(self, games: list[RemoteGame], call) -> list[tuple[list[RemoteGame], Future]]:
        """``call(host, its games)`` sent to every worker holding some of ``games``, all at once:
        the calls in flight, each with the games it is about."""
        by_worker: dict[int, list[RemoteGame]] = {}
        for g in games:
            by_worker.setdefault(g.worker, []).append(g)
        return [(mine, self.threads.submit(call, self.hosts[w], mine)) for w, mine in by_worker.items()]

    def close(self) -> None:
        self.threads.shutdown()
        for m in self.managers:
            m.shutdown()


def reset_games(games: list) -> list[Observation]:
    """Reset a batch of games (``Game`` or ``RemoteGame``); remote ones at once on their workers."""
    if not games or not isinstance(games[0], RemoteGame):
        return [g.reset() for g in games]
    for mine, call in games[0].workers.each(games, lambda host, mine: host.reset([g.key for g in mine])):
        for g, (obs, walkthrough) in zip(mine, call.result()):
            g.observation, g.walkthrough, g.history = obs, walkthrough, []
    return [g.observation for g in games]


class Steps:
    """Steps in flight (or done); ``result()`` waits for them, updates the games' mirrored state and
    returns the step results in the order of the games."""

    def __init__(self, games: list, calls: list[tuple[list[RemoteGame], Future]] | None = None,
                 results: list[StepResult] | None = None):
        self.games, self.calls, self.results = games, calls, results

    def result(self) -> list[StepResult]:
        if self.results is None:
            by_game = {}
            for mine, call in self.calls:
                for g, (result, history) in zip(mine, call.result()):
                    g.observation, g.history = result.observation, history
                    by_game[id(g)] = result
            self.results = [by_game[id(g)] for g in self.games]
        return self.results


def step_games_async(games: list, commands: list[str]) -> Steps:
    """Send a batch of games one command each. On workers the steps run while the caller goes on;
    games in this process step before this returns."""
    if not games or not isinstance(games[0], RemoteGame):
        return Steps(games, results=[g.step(c) for g, c in zip(games, commands)])
    command_of = {id(g): c for g, c in zip(games, commands)}
    return Steps(games, games[0].workers.each(games, lambda host, mine: host.step([(g.key, command_of[id(g)]) for g in mine])))


def step_games(games: list, commands: list[str]) -> list[StepResult]:
    """Step a batch of games, one command each; remote ones at once on their workers."""
    return step_games_async(games, commands).result()

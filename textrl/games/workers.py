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

A fault costs the episodes it touches, not the rollout: a game whose engine raises or answers late
comes back as its ``GameFault`` (with the worker's traceback) among its worker's other answers. A
worker that dies, or does not answer a call within ``env.step_timeout`` per game in it, is killed
and replaced by a new process at once; all the games it held answer with a ``GameFault`` from then
on (their state died with it: their episodes are aborted, not re-opened), and the next ``open``
places games on the new process.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as CallTimeout
from dataclasses import dataclass
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Callable

from textrl.games.env import Game, GameFault, Observation, StepResult, Turn, open_game

log = logging.getLogger(__name__)


class GameHost:
    """Lives in a worker: the games it holds, by key. A game's fault is its answer; the others'
    answers come back with it."""

    def __init__(self):
        self.games: dict[int, Game] = {}

    def open(self, key: int, game_file: str, env) -> None:
        self.games[key] = open_game(game_file, env)

    def reset(self, keys: list[int]) -> list[tuple[Observation, list[str]] | GameFault]:
        out = []
        for k in keys:
            try:
                out.append((self.games[k].reset(), self.games[k].walkthrough))
            except GameFault as fault:
                out.append(fault)
        return out

    def step(self, moves: list[tuple[int, str]]) -> list[tuple[StepResult, list[Turn]] | GameFault]:
        out = []
        for key, command in moves:
            game = self.games[key]
            try:
                out.append((game.step(command), game.history))
            except GameFault as fault:
                out.append(fault)
        return out

    def close(self, keys: list[int]) -> None:
        for k in keys:
            self.games.pop(k).close()


class _Manager(BaseManager):
    pass


def _new_host(make_host: Callable[[], GameHost]) -> GameHost:
    return make_host()


_Manager.register("GameHost", _new_host)


class RemoteGame:
    """A game held by a worker, seen from the training process as a ``Game``. ``generation``: which
    of the worker's processes holds it (a replaced worker's games are gone)."""

    def __init__(self, workers: GameWorkers, worker: int, key: int, game_file: str | Path, step_timeout: float):
        self.workers, self.worker, self.key = workers, worker, key
        self.generation = workers.generation[worker]
        self.step_timeout = step_timeout
        self.game_file = Path(game_file)
        self.observation: Observation | None = None
        self.history: list[Turn] = []
        self.walkthrough: list[str] = []

    def reset(self) -> Observation:
        return _raised(reset_games([self])[0])

    def step(self, command: str) -> StepResult:
        return _raised(step_games([self], [command])[0])

    def close(self) -> None:
        self.workers.close_games([self])


def _raised(answer):
    if isinstance(answer, GameFault):
        raise answer
    return answer


@dataclass
class Call:
    """One call in flight to one worker, about ``games``; ``lost``: the worker process that held them
    had already ended (nothing was sent)."""

    worker: int
    generation: int
    games: list[RemoteGame]
    future: Future | None
    deadline: float = 0.0
    lost: str | None = None


class GameWorkers:
    """W worker processes that hold and step games; ``open`` places games on them. ``host`` makes
    what holds a worker's games: a ``GameHost`` (tests pass one that injects faults)."""

    def __init__(self, n: int, host: Callable[[], GameHost] = GameHost):
        if n < 1:
            raise ValueError(f"step workers must be >= 1, got {n}")
        self.ctx = mp.get_context("spawn")
        self.make_host = host
        self.managers: list[_Manager] = [None] * n
        self.hosts: list = [None] * n
        self.generation = [0] * n
        self.ended: dict[tuple[int, int], str] = {}  # (worker, generation) -> how that process ended
        for w in range(n):
            self._start(w)
        # a call in flight per worker for each of two groups of games (run_episodes' overlap)
        self.threads = ThreadPoolExecutor(max_workers=2 * n)
        self.in_flight: list[Call] = []
        self.next_key = 0

    def _start(self, w: int) -> None:
        self.managers[w] = _Manager(ctx=self.ctx)
        self.managers[w].start()
        self.hosts[w] = self.managers[w].GameHost(self.make_host)

    def open(self, game_files: list[str | Path], env) -> list[RemoteGame]:
        """The games, opened on the workers (game ``i`` on worker ``i % W``). A worker that dies or
        hangs while opening is replaced; its games are born faulted (their episodes abort at reset)."""
        for w, m in enumerate(self.managers):  # a worker that died since its last call
            if not m._process.is_alive():
                self._replace(w, self.generation[w], "died")
        games = []
        for i, path in enumerate(game_files):
            games.append(RemoteGame(self, i % len(self.hosts), self.next_key, path, env.step_timeout))
            self.next_key += 1
        for call in self.send(games, lambda host, mine: [host.open(g.key, str(g.game_file), env) for g in mine]):
            self.collect(call)
        return games

    def send(self, games: list[RemoteGame], call) -> list[Call]:
        """``call(host, its games)`` sent to every worker holding some of ``games``, all at once, each
        to answer within ``step_timeout`` per game; games whose process has ended get no call."""
        self.in_flight = [c for c in self.in_flight if not c.future.done()]
        by_worker: dict[tuple[int, int], list[RemoteGame]] = {}
        for g in games:
            by_worker.setdefault((g.worker, g.generation), []).append(g)
        calls = []
        for (w, generation), mine in by_worker.items():
            if generation != self.generation[w]:
                calls.append(Call(w, generation, mine, None, lost=self.ended[w, generation]))
                continue
            deadline = time.monotonic() + sum(g.step_timeout for g in mine)
            calls.append(Call(w, generation, mine, self.threads.submit(call, self.hosts[w], mine), deadline))
            self.in_flight.append(calls[-1])
        return calls

    def collect(self, call: Call) -> list:
        """A call's answers, one per game in order: the game's answer, or its ``GameFault``. A worker
        that died, or gave no answer by the call's deadline, is killed and replaced: all its games'
        answers are faults."""
        if call.lost is None:
            try:
                return call.future.result(timeout=max(0.0, call.deadline - time.monotonic()))
            except CallTimeout:  # before OSError: it is one
                waited = sum(g.step_timeout for g in call.games)
                self._replace(call.worker, call.generation, f"gave no answer within {waited:g} s "
                              f"(env.step_timeout per game of the call)")
            except (OSError, EOFError):
                if call.generation == self.generation[call.worker] and self._running(call.worker):
                    raise  # a game's own error (the connection is fine), not a dead worker
                self._replace(call.worker, call.generation, "died")
            call.lost = self.ended[call.worker, call.generation]
        return [GameFault(str(g.game_file), f"its step worker {call.worker} {call.lost}") for g in call.games]

    def _running(self, w: int) -> bool:
        process = self.managers[w]._process
        process.join(timeout=1.0)  # a dying process: let it finish
        return process.is_alive()

    def _replace(self, w: int, generation: int, how: str) -> None:
        """Kill worker ``w``'s process ``generation`` (if it is still the current one) and start a new one."""
        if generation != self.generation[w]:
            return  # already replaced: another call found it first
        process = self.managers[w]._process
        if how == "died":
            process.join(timeout=1.0)  # a dying process: let it finish, for its exit code
        if process.is_alive():
            process.kill()
            process.join()
        if how == "died":
            how = f"died (exit code {process.exitcode})"
        self.ended[w, generation] = how
        log.warning("step worker %d (pid %s) %s: replaced by a new process; the episodes of the games it held "
                    "are aborted", w, process.pid, how)
        self.managers[w].shutdown()  # its process has ended: only the bookkeeping is left
        self.generation[w] += 1
        self._start(w)

    def close_games(self, games: list[RemoteGame]) -> None:
        """Close games on their workers; those on a process that ended are gone already."""
        for call in self.send(games, lambda host, mine: host.close([g.key for g in mine])):
            self.collect(call)

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        for w in {c.worker for c in self.in_flight if not c.future.done()}:
            self.managers[w]._process.kill()  # a call still in flight: a stuck worker answers no shutdown
        for m in self.managers:
            m.shutdown()


def _answer(call, *args):
    """A game's answer in this process, or its fault."""
    try:
        return call(*args)
    except GameFault as fault:
        return fault


def reset_games(games: list) -> list[Observation | GameFault]:
    """Reset a batch of games (``Game`` or ``RemoteGame``); remote ones at once on their workers.
    A game whose reset faulted answers with its ``GameFault``."""
    if not games or not isinstance(games[0], RemoteGame):
        return [_answer(g.reset) for g in games]
    workers = games[0].workers
    by_game = {}
    for call in workers.send(games, lambda host, mine: host.reset([g.key for g in mine])):
        for g, answer in zip(call.games, workers.collect(call)):
            if not isinstance(answer, GameFault):
                g.observation, g.walkthrough, g.history = answer[0], answer[1], []
                answer = g.observation
            by_game[id(g)] = answer
    return [by_game[id(g)] for g in games]


class Steps:
    """Steps in flight (or done); ``result()`` waits for them, updates the games' mirrored state and
    returns the step results (or ``GameFault``s) in the order of the games."""

    def __init__(self, games: list, calls: list[Call] | None = None, results: list | None = None):
        self.games, self.calls, self.results = games, calls, results

    def result(self) -> list[StepResult | GameFault]:
        if self.results is None:
            by_game = {}
            for call in self.calls:
                for g, answer in zip(call.games, self.games[0].workers.collect(call)):
                    if not isinstance(answer, GameFault):
                        g.observation, g.history = answer[0].observation, answer[1]
                        answer = answer[0]
                    by_game[id(g)] = answer
            self.results = [by_game[id(g)] for g in self.games]
        return self.results


def step_games_async(games: list, commands: list[str]) -> Steps:
    """Send a batch of games one command each. On workers the steps run while the caller goes on;
    games in this process step before this returns."""
    if not games or not isinstance(games[0], RemoteGame):
        return Steps(games, results=[_answer(g.step, c) for g, c in zip(games, commands)])
    command_of = {id(g): c for g, c in zip(games, commands)}
    return Steps(games, games[0].workers.send(games, lambda host, mine: host.step([(g.key, command_of[id(g)]) for g in mine])))


def step_games(games: list, commands: list[str]) -> list[StepResult | GameFault]:
    """Step a batch of games, one command each; remote ones at once on their workers. A game whose
    step faulted answers with its ``GameFault``; the others' results are kept."""
    return step_games_async(games, commands).result()

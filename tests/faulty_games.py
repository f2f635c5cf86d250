"""Faults injected into real games, for tests/test_game_faults.py: ``inject`` wraps a game's engine
step so that its k-th call faults; ``FaultyHost`` does it inside a step-worker process. Worker
processes import this module, so it imports the games layer only."""

from __future__ import annotations

import itertools
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

from textrl.games.workers import GameHost

SLOW_S = 1.5  # answers_late: longer than the tests' env.step_timeout=1


# each fault: (game, its real engine step, the command) -> what the engine answers, or never
def engine_raises(game, step, command):
    raise RuntimeError(f"the engine of {game.game_file.name} broke")


def answers_late(game, step, command):
    time.sleep(SLOW_S)
    return step(command)


def never_answers(game, step, command):
    time.sleep(3600)


def worker_dies(game, step, command):
    os.kill(os.getpid(), signal.SIGKILL)


def engine_dies(game, step, command):  # TextWorldExpress: its Java process
    java = game._env._gateway.java_process
    java.kill()
    java.wait()
    return step(command)


def engine_stops(game, step, command):  # TextWorldExpress: its Java process stopped, never answering
    pid = game._env._gateway.java_process.pid
    os.kill(pid, signal.SIGSTOP)
    # kill() returns before the JVM's threads have all stopped: on a busy machine its socket thread
    # could still answer this step (CI saw it answer, and step K+1 fault instead)
    wait_until_stopped(pid)
    return step(command)


def wait_until_stopped(pid: int, within_s: float = 10.0) -> None:
    """Until every thread of ``pid`` is in the stopped state ('T' in /proc/PID/task/*/stat); where
    there is no /proc (macOS), a pause instead."""
    if not Path(f"/proc/{pid}/task").is_dir():
        time.sleep(1.0)
        return
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        states = []
        for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):  # a thread that ended meanwhile
                pass
        if states and all(s in "Tt" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {within_s} s of SIGSTOP")


def no_commands(game, step, command):
    return replace(step(command), admissible_commands=[])


FAULTS = {f.__name__: f for f in (engine_raises, answers_late, never_answers, worker_dies, engine_dies,
                                   engine_stops, no_commands)}


def inject(game, at_step: int, fault) -> None:
    """``game``'s ``at_step``-th engine step runs ``fault`` (by function or name) instead."""
    fault = FAULTS.get(fault, fault)
    step, calls = game._step, itertools.count(1)
    game._step = lambda command: fault(game, step, command) if next(calls) == at_step else step(command)


class FaultyHost(GameHost):
    """A worker's GameHost that can make one of its games fault (``inject``, called through the proxy)."""

    def inject(self, key: int, at_step: int, fault: str) -> None:
        inject(self.games[key], at_step, fault)

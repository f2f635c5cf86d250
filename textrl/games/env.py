"""One game behind ``reset()`` / ``step(command)``: a TextWorld story (``TextGame``) or a
TextWorldExpress game (``ExpressGame``, its engine in ``textrl.games.express``); ``open_game`` picks
by the file.

Reward per step = score change + ``win_bonus`` on the winning step − ``step_penalty``. With
``block_repeats`` a step's observation offers only the commands played fewest times from its state
in the episode (while some were not played, those).
The losing step also costs ``loss_penalty`` and the step penalty of every step the loss leaves
unplayed: a lost episode costs what one played to ``max_steps`` without winning costs, plus
``loss_penalty``, so losing is never a shortcut past the step penalty (charged only the losing
step's penalty, policies on tw-treasure_hunter and Pecking Order learned to take a wrong object at
once and lose). An episode ends when the game is won or lost
(``terminated``; only some families can be lost, e.g. tw-cooking: a burnt ingredient, an eaten one) or after
``max_steps`` commands (``truncated``). A game that offers no admissible command after a step ends
the episode there, ``terminated`` though neither won nor lost: no command, hence no future reward,
can follow (a game with none at its start cannot be played: ``textrl.rollout`` aborts it). A command
that is not admissible is refused before it reaches the game.

Every call into the engine (``reset``, a step) goes through ``Game._call``: an exception, or an
answer later than ``env.step_timeout``, becomes a ``GameFault`` that names the game and carries the
engine's own traceback; the caller aborts that episode only. Here, in the process that plays, a
TextWorld game cannot be interrupted: a late answer is a fault once it comes, a game that never
answers blocks (``textrl.games.workers`` runs games where they can be killed). A TextWorldExpress
engine is a Java process: its calls are cut at ``step_timeout`` and a faulted engine is shut down,
never reused.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import textworld

from textrl.errors import GameFileError
from textrl.games.express import borrow_engine, read_descriptor, return_engine, shut_down


def release_engine_state() -> None:
    """Drop what the game engines keep from the last game they opened. TextWorld's logic parser (a
    module global, tatsu's) keeps its last parse's failed alternatives, exceptions whose tracebacks
    hold every frame that opened the game, up to the training loop: until the next game is parsed,
    the Trainer and the model of the run that opened it stay alive. Called when a job ends."""
    import textworld.logic

    parser = getattr(textworld.logic, "_PARSER", None)
    if parser is None:
        return
    if hasattr(parser, "_furthest_exception"):
        parser._furthest_exception = None
    if hasattr(parser, "_clear_memoization_caches"):
        parser._clear_memoization_caches()


def request_infos() -> textworld.EnvInfos:
    """What textrl reads of a TextWorld state."""
    return textworld.EnvInfos(objective=True, description=True, inventory=True, admissible_commands=True,
                              score=True, max_score=True, won=True, lost=True, extras=["walkthrough"])


class InvalidCommandError(ValueError):
    """A command that is not in the current admissible set."""


class GameFault(GameFileError):
    """A game whose engine raised, answered later than ``env.step_timeout`` or died (its worker
    process, its Java engine): a rollout aborts its episode and goes on; elsewhere (a CLI playing
    one game) it is the game file its engine could not play. ``detail``: the engine's own
    traceback, where there is one."""

    def __init__(self, game_file: str, reason: str, detail: str = ""):
        super().__init__(game_file, reason, detail)  # the args pickle: faults travel back from step workers
        self.game_file, self.reason, self.detail = game_file, reason, detail

    def __str__(self) -> str:
        return f"{self.game_file}: {self.reason}"


@dataclass
class Observation:
    objective: str
    description: str
    inventory: str
    feedback: str  # what the game answered to the last command ("" after reset)
    admissible_commands: list[str]
    score: float  # TextWorld: points; TextWorldExpress: its normalized score (1 = done)
    max_score: float
    won: bool
    lost: bool

    @property
    def state(self) -> tuple[str, str]:
        """What the game shows of its state: the room description and the inventory (not the feedback,
        which tells how the state was reached). GiGPO's step groups and ``block_repeats`` read it."""
        return self.description, self.inventory


@dataclass
class Turn:
    """One past step: what the agent saw, and what it did."""

    observation: Observation
    command: str
    answer_to: str = ""  # the command whose answer the observation is ("" on an episode's first turn)


def kept_answers(history: Sequence[Turn], verbs: Sequence[str]) -> set[int]:
    """The turns a history cut keeps (``env.keep_answers``): for each command whose first word is one
    of ``verbs``, the latest turn whose observation answers it (a recipe read, a map read). The answer
    is shown on the turn after the command, so that is the turn kept; an older answer to the same
    command gives way to the newer one, which bounds the kept turns by the game's distinct commands."""
    latest: dict[str, int] = {}
    for i, turn in enumerate(history):
        if turn.answer_to and turn.answer_to.split(" ", 1)[0] in verbs:
            latest[turn.answer_to] = i
    return set(latest.values())


def drop_oldest(history: list[Turn], count: int, verbs: Sequence[str] = ()) -> None:
    """Delete up to ``count`` turns from ``history`` in place, the oldest first, passing over the
    turns ``kept_answers`` keeps: while any other turn is left, only those go (fewer than ``count``
    where fewer are left); when only kept turns are left, they go, oldest first. At least one turn
    goes from a history that has one, so a caller's loop ends."""
    kept = kept_answers(history, verbs)
    others = [i for i in range(len(history)) if i not in kept]
    gone = set((others or sorted(kept))[:count])
    history[:] = [turn for i, turn in enumerate(history) if i not in gone]


@dataclass
class StepResult:
    observation: Observation
    reward: float
    terminated: bool  # won, lost, or no command left: no value to bootstrap
    truncated: bool  # step limit reached
    info: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


_BANNER_LINE = re.compile(r"^\s*>.*$|^\s*-= .* =-\s*\d+/\d+\s*$", re.MULTILINE)


def clean_feedback(text: str) -> str:
    """Drop the command prompt / status-bar lines and the end-of-game menu; squeeze blank lines."""
    text = text.split("*** The End ***")[0]
    text = text.split("*** You lost! ***")[0]  # a lost game's banner (tw-cooking), then its score line
    text = text.split("Would you like to RESTART")[0]
    text = _BANNER_LINE.sub("", text)
    return re.sub(r"\n\s*\n+", "\n", text).strip()


_LENGTH_SCALE = {1: 2, 2: 2, 3: 2, 4: 4, 5: 4, 6: 8, 7: 8, 8: 8}


def check_game_file(path: Path) -> None:
    """Refuse files the game interpreter would hang on or misread: a Z-machine story must have a
    valid version byte and be at least as long as its header says, a Glulx one its magic number,
    and TextWorld needs the game's ``.json`` beside it for admissible commands. A TextWorldExpress
    descriptor (``.twx``) must name a game, its parameters, fold and seed."""
    path = Path(path)
    if not path.is_file():
        raise GameFileError(f"game file {path} does not exist; generate games with textrl.games.pool.GamePool")
    if path.suffix == ".twx":
        read_descriptor(path)
        return
    data = path.read_bytes()[:64]
    if path.suffix == ".ulx":
        if data[:4] != b"Glul":
            raise GameFileError(f"{path} is not a Glulx game (no Glul header); delete it or pass the right file")
    else:
        version = data[0] if data else 0
        declared = int.from_bytes(data[0x1A:0x1C], "big") * _LENGTH_SCALE.get(version, 0) if len(data) == 64 else 0
        if version not in _LENGTH_SCALE or declared == 0 or declared > path.stat().st_size:
            raise GameFileError(f"{path} is not a complete Z-machine game (truncated or corrupt); delete it so "
                                f"the pool regenerates it")
    meta = path.with_suffix(".json")
    try:
        json.loads(meta.read_text())
    except (OSError, ValueError) as exc:
        raise GameFileError(f"{meta} is missing or corrupt ({exc}); delete the game's folder so the pool "
                            f"regenerates it") from exc


class _Expired(BaseException):
    """A game call ran past its deadline (raised by ``_deadline``'s alarm; not an ``Exception``, so
    that the engine's own handlers do not swallow it)."""


@contextmanager
def _deadline(seconds: float | None):
    """Inside, in the main thread of a POSIX process, a call still running after ``seconds`` is
    interrupted: SIGALRM raises ``_Expired`` in it. Python code and blocking reads (TextWorld's
    interpreter subprocess) are interrupted; a loop inside a C extension only when it returns.
    Elsewhere (worker threads, where the parent's deadline kills the worker instead), or when
    SIGALRM already has a handler of someone else's, nothing is armed."""
    armed = (seconds is not None and hasattr(signal, "setitimer")
             and threading.current_thread() is threading.main_thread()
             and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None))
    if not armed:
        yield
        return

    def expire(signum, frame):
        raise _Expired()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Game:
    """One game behind ``reset()`` / ``step(command)`` with the textrl reward, step limit,
    admissibility check and a bounded history of turns; the engine (TextWorld, TextWorldExpress)
    is a subclass's ``_start`` / ``_reset`` / ``_step`` / ``close``.

    The history holds at most ``history_len`` turns. When it would exceed that, the oldest half is
    dropped at once rather than one turn per step (passing over the answers ``keep_answers`` keeps,
    ``drop_oldest``; a cut on both sides of a kept turn takes two stretches, which the decoder does
    not drop from its cache: the row starts again from position 0): the prompt then keeps
    extending the previous one for ``history_len // 2`` turns (with ``env.drop_turns_from_cache``
    the decoder drops the cut turns from its KV cache and feeds only the new tokens,
    ``textrl.policy.speed.stream``), and fewer cuts keep more turns in view on average.
    """

    interrupt_late_calls = True  # a call still running at step_timeout is interrupted (``_deadline``)

    def __init__(self, game_file: str | Path, max_steps: int, step_penalty: float = 0.1,
                 win_bonus: float = 1.0, history_len: int = 8, loss_penalty: float = 1.0, *,
                 step_timeout: float | None = None, keep_answers: Sequence[str] = (), block_repeats: bool = False):
        game_file = Path(game_file)
        check_game_file(game_file)
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps}")
        if history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {history_len}")
        self.game_file = game_file
        self.max_steps = max_steps
        self.step_penalty = step_penalty
        self.win_bonus = win_bonus
        self.loss_penalty = loss_penalty
        self.history_len = history_len
        self.keep_answers = tuple(keep_answers)  # verbs whose latest answer a history cut keeps (drop_oldest)
        self.step_timeout = step_timeout  # seconds an engine call may take (None: unbounded)
        self.block_repeats = block_repeats  # a state offers its least-played commands of the episode
        self._played: Counter[tuple[str, str, str]] = Counter()  # times each (state, command) was played
        self.fault: GameFault | None = None  # the engine's last fault: it is not reused
        self.history: list[Turn] = []
        self._answer_to = ""
        self.observation: Observation | None = None
        self.steps = 0
        self.walkthrough: list[str] = []  # the game's own winning commands (TextWorld's walkthrough, TWX's gold path)
        self._start()

    @classmethod
    def for_env(cls, game_file: str | Path, env) -> Game:
        """The game with an EnvConfig's step limit, rewards, history length and step timeout."""
        return cls(game_file, env.max_steps, env.step_penalty, env.win_bonus, env.history_len, env.loss_penalty,
                   step_timeout=env.step_timeout, keep_answers=env.keep_answers, block_repeats=env.block_repeats)

    # ---- the engine ------------------------------------------------------------------------
    def _start(self) -> None:
        raise NotImplementedError

    def _reset(self) -> tuple[Observation, list[str]]:
        """The first observation and the walkthrough."""
        raise NotImplementedError

    def _step(self, command: str) -> Observation:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _call(self, what: str, engine_call, *args):
        """``engine_call(*args)``; its exception, or an answer later than ``step_timeout``, raised as
        the game's ``GameFault`` (kept in ``fault``) with the engine's traceback. In the main thread
        a call still running at ``step_timeout`` is interrupted (``_deadline``)."""
        start = time.perf_counter()
        try:
            with _deadline(self.step_timeout if self.interrupt_late_calls else None):
                answer = engine_call(*args)
        except _Expired:
            self.fault = GameFault(str(self.game_file), f"{what} gave no answer within "
                                   f"env.step_timeout={self.step_timeout:g} s", traceback.format_exc())
            raise self.fault from None
        except Exception as exc:
            self.fault = GameFault(str(self.game_file), f"{what} raised {type(exc).__name__}: {exc}",
                                   traceback.format_exc())
            raise self.fault from exc
        took = time.perf_counter() - start
        if self.step_timeout is not None and took > self.step_timeout:
            self.fault = GameFault(str(self.game_file), f"{what} answered after {took:.1f} s, more than "
                                   f"env.step_timeout={self.step_timeout:g} s")
            raise self.fault
        return answer

    # ---- the episode -----------------------------------------------------------------------
    def reset(self) -> Observation:
        self.observation, walkthrough = self._call("reset", self._reset)
        self.walkthrough = list(walkthrough)
        self.history.clear()
        self._answer_to = ""  # the last command played: the next turn's observation answers it
        self._played.clear()
        self.steps = 0
        return self.observation

    def step(self, command: str) -> StepResult:
        obs = self.observation
        if obs is None:
            raise RuntimeError("call reset() before step()")
        if obs.won or obs.lost or self.steps >= self.max_steps or not obs.admissible_commands:
            raise RuntimeError("the episode is over; call reset() to start again")
        if command not in obs.admissible_commands:
            raise InvalidCommandError(
                f"{command!r} is not admissible here; admissible commands: {obs.admissible_commands}")
        new = self._call(f"step {self.steps + 1} ({command!r})", self._step, command)
        self._played[(*obs.state, command)] += 1
        self.steps += 1
        self.history.append(Turn(obs, command, self._answer_to))
        self._answer_to = command
        if len(self.history) > self.history_len:
            drop_oldest(self.history, max(1, self.history_len // 2), self.keep_answers)
        if self.block_repeats:
            new = self._without_repeats(new)
        self.observation = new
        reward = ((new.score - obs.score) + (self.win_bonus if new.won else 0.0)
                  - (self._lost_cost() if new.lost else 0.0) - self.step_penalty)
        terminated = new.won or new.lost or not new.admissible_commands  # no command: nothing can follow
        truncated = not terminated and self.steps >= self.max_steps
        return StepResult(new, reward, terminated, truncated, {"won": new.won, "steps": self.steps})

    def _without_repeats(self, obs: Observation) -> Observation:
        """``obs`` offering only the commands played fewest times from its state in this episode: the
        ones not played yet, and where every one was, those played least. Offering all of them again
        there let a policy trained with the rule play ``look`` to the step limit in a room it had
        exhausted (docs/results.md); fewest-first makes every cycle through a state take each
        command in turn. Never none: a game is not ended by the rule."""
        if not obs.admissible_commands:
            return obs
        times = [self._played[(*obs.state, c)] for c in obs.admissible_commands]
        least = min(times)
        return replace(obs, admissible_commands=[c for c, n in zip(obs.admissible_commands, times) if n == least])

    def _lost_cost(self) -> float:
        """What the losing step costs beyond its own step penalty: ``loss_penalty`` and the penalty of
        the steps left to ``max_steps`` (the module docstring says why)."""
        return self.loss_penalty + self.step_penalty * (self.max_steps - self.steps)


class TextGame(Game):
    """A TextWorld game file (``.z8`` / ``.ulx`` with its ``.json``)."""

    def _start(self) -> None:
        try:
            with warnings.catch_warnings():
                # Jericho cannot track score for TextWorld stories; TextWorld tracks it itself.
                warnings.filterwarnings("ignore", message=".*is not fully supported.*")
                self._env = textworld.start(str(self.game_file), request_infos=request_infos())
        except Exception as exc:
            raise GameFileError(f"TextWorld cannot load {self.game_file}: {exc}. Delete it so the pool regenerates it.") from exc

    def _observe(self, state, feedback: str) -> Observation:
        return Observation(
            objective=state["objective"].strip(),
            description=state["description"].strip(),
            inventory=state["inventory"].strip(),
            feedback=feedback,
            admissible_commands=sorted(state["admissible_commands"]),
            score=int(state["score"]),
            max_score=int(state["max_score"]),
            won=bool(state["won"]),
            lost=bool(state["lost"]),
        )

    def _reset(self) -> tuple[Observation, list[str]]:
        try:
            state = self._env.reset()
        except Exception as exc:
            raise GameFileError(f"TextWorld cannot start {self.game_file}: {exc}. Delete it so the pool regenerates it.") from exc
        return self._observe(state, feedback=""), state.get("extra.walkthrough") or []

    def _step(self, command: str) -> Observation:
        state, _, _ = self._env.step(command)
        return self._observe(state, clean_feedback(state.feedback))

    def close(self) -> None:
        self._env.close()


class ExpressGame(Game):
    """A TextWorldExpress game, from its ``.twx`` descriptor."""

    # its calls are bounded by the engine connection's own socket timeout (express.set_timeout),
    # which leaves py4j's connection in a known state; an alarm could cut a read half-way
    interrupt_late_calls = False

    def _start(self) -> None:
        self._spec = read_descriptor(self.game_file)
        self._env = borrow_engine(self.step_timeout)

    def _observe(self, infos: dict, feedback: str) -> Observation:
        return Observation(
            objective=infos["taskDescription"].strip(),
            description=infos["look"].strip(),
            inventory=infos["inventory"].strip(),
            feedback=feedback,
            admissible_commands=sorted(set(infos["validActions"])),
            score=float(infos["score"]),
            max_score=1.0,
            won=bool(infos["tasksuccess"]),
            lost=bool(infos["taskfailure"]),
        )

    def _reset(self) -> tuple[Observation, list[str]]:
        s = self._spec
        try:
            observation, infos = self._env.reset(seed=s["seed"], gameFold=s["fold"], gameName=s["game"],
                                                 gameParams=s["params"], generateGoldPath=True)
        except Exception as exc:  # py4j / engine errors: a descriptor the engine cannot play
            raise GameFileError(f"TextWorldExpress cannot start {self.game_file} ({s}): {exc}") from exc
        # the opening observation is often more than the room (Simon Says: the first order)
        return self._observe(infos, observation.strip()), self._env.getGoldActionSequence()

    def _step(self, command: str) -> Observation:
        observation, _, _, infos = self._env.step(command)
        return self._observe(infos, observation.strip())

    def close(self) -> None:
        if self._env is not None:
            # a faulted engine (dead, stuck, or in a state nobody knows) is never reused
            (shut_down if self.fault is not None else return_engine)(self._env)
            self._env = None


def open_game(game_file: str | Path, env) -> Game:
    """The game behind a game file, with an EnvConfig's step limit, rewards and history length:
    a TextWorld story, or a TextWorldExpress game descriptor (``.twx``, written by the pool)."""
    if Path(game_file).suffix == ".twx":
        return ExpressGame.for_env(game_file, env)
    return TextGame.for_env(game_file, env)

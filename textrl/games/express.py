"""TextWorldExpress's engine and game descriptors (CookingWorld, Coin Collector, TWC, MapReader,
Arithmetic, Sorting, Simon Says, Pecking Order); ``textrl.games.env.ExpressGame`` plays them behind
the same ``Game`` interface as TextWorld's.

TextWorldExpress generates a game from (game name, parameters, fold, seed) inside a Java engine
(its JAR, driven over py4j). The pool writes that tuple as a small JSON descriptor, ``game.twx``,
so every layer above the environment (pool, datamodule, rollout, transcripts, ``textrl-eval
--games``) keeps addressing games by file. textrl's ``train`` split plays TWX's train fold and its
``eval`` split the dev fold (the test fold stays unused, for a final check). The score is TWX's
normalized score (1 when the task is done), so a winning episode gains 1 point plus the win bonus.

Each engine is a Java process (about 0.3 s to start): up to ``IDLE_ENGINES`` are kept after their
games close and reused by the next ones (more games open at once start more, shut down when they
close); the kept ones end with the Python process (py4j's ``die_on_exit``). A game's calls into its
engine are cut after its step timeout (a socket timeout: the engine never answers otherwise); an
engine that died, or faulted, is shut down, never put back.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from textworld_express import TextWorldExpressEnv

from textrl.errors import ConfigError, GameFileError

FOLDS = {"train": "train", "eval": "dev"}  # textrl split -> TextWorldExpress fold
JAVA_MISSING = ("TextWorldExpress runs its game engine in Java, and no `java` is on the PATH. Install a Java "
                "runtime (11 or newer), e.g. `sudo apt-get install -y default-jre-headless` (Debian/Ubuntu), "
                "`brew install openjdk` (macOS) or `conda install -c conda-forge openjdk`, then run again.")

IDLE_ENGINES = 16  # engines kept for the next games: a rollout's or an evaluation batch's (16 by default)
# each engine's Java heap: the JVM's own default maximum is a quarter of the machine's memory, which a
# long-lived engine fills with garbage before it collects (bench/soak.py); a game's state is small
JAVA_HEAP = "-Xmx128m"
_idle: list = []  # started engines no game is using (each closes itself when garbage-collected)
logging.getLogger("py4j").setLevel(logging.WARNING)  # py4j announces every engine's sockets at INFO


def java_available() -> bool:
    return shutil.which("java") is not None


def borrow_engine(timeout: float | None = None):
    """An idle engine, or a new one, whose calls fail after ``timeout`` seconds without an answer
    (None: wait); give it back with ``return_engine`` when its game closes."""
    while _idle:
        engine = _idle.pop()
        if running(engine):
            return set_timeout(engine, timeout)
        shut_down(engine)  # died while idle
    if not java_available():
        raise GameFileError(JAVA_MISSING)
    # the step limit is textrl's (Game.max_steps); the engine's own one must never cut in first
    with _java_options(JAVA_HEAP):
        engine = TextWorldExpressEnv(envStepLimit=10**9)
    return set_timeout(engine, timeout)


@contextmanager
def _java_options(options: str):
    """``JAVA_TOOL_OPTIONS`` for the JVMs started inside (TextWorldExpress fixes the JVM's command
    line; the JVM reads this variable at start), the previous value back afterwards."""
    previous = os.environ.get("JAVA_TOOL_OPTIONS")
    os.environ["JAVA_TOOL_OPTIONS"] = f"{previous} {options}" if previous else options
    try:
        yield
    finally:
        if previous is None:
            del os.environ["JAVA_TOOL_OPTIONS"]
        else:
            os.environ["JAVA_TOOL_OPTIONS"] = previous


def return_engine(engine) -> None:
    """Keep a running engine for the next game, while the idle pool has room; shut it down otherwise."""
    if running(engine) and len(_idle) < IDLE_ENGINES:
        _idle.append(engine)
    else:
        shut_down(engine)


def running(engine) -> bool:
    return engine._gateway.java_process.poll() is None


def set_timeout(engine, timeout: float | None):
    """py4j reads each answer from a socket: a timeout on it bounds every call (and ends it with a
    py4j error, never a retry); connections already open get it too."""
    client = engine._gateway._gateway_client
    client.gateway_parameters.read_timeout = timeout
    for connection in list(client.deque):
        connection.socket.settimeout(timeout)
    return engine


def shut_down(engine) -> None:
    """End an engine's Java process (dead, stuck or healthy: killed, it holds nothing to save), its
    sockets and its Python callback server."""
    gateway = engine._gateway
    if gateway.java_process.poll() is None:
        gateway.java_process.kill()
    gateway.java_process.wait()
    gateway._gateway_client.close()
    gateway._gateway_client.is_connected = False  # TWX's own close() (at garbage collection) then sends nothing
    gateway.shutdown_callback_server()


def params_text(settings: dict) -> str:
    """TWX's parameter string: ``numLocations=3,includeDoors=0`` (booleans as 0/1)."""
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in settings.items())


def check_params(game: str, settings: dict) -> None:
    """Let the engine judge the parameters (it names unknown ones and out-of-range values)."""
    engine = borrow_engine()
    try:
        engine.load(game, params_text(settings))
    except ValueError as exc:
        raise ConfigError(f"env.settings={dict(settings)} for TextWorldExpress game {game!r}: {exc}".strip()) from None
    finally:
        return_engine(engine)


def fold_seeds(game: str, settings: dict, split: str) -> list[int]:
    """The engine's valid seeds of the fold that textrl's ``split`` plays, in order."""
    engine = borrow_engine()
    try:
        engine.load(game, params_text(settings))
        return list(engine.getValidSeedsTrain() if FOLDS[split] == "train" else engine.getValidSeedsDev())
    finally:
        return_engine(engine)


def write_descriptor(path: Path, game: str, settings: dict, split: str, seed: int) -> None:
    path.write_text(json.dumps({"game": game, "params": params_text(settings), "fold": FOLDS[split], "seed": seed}))


def read_descriptor(path: Path) -> dict:
    try:
        d = json.loads(Path(path).read_text())
        if not (isinstance(d["game"], str) and isinstance(d["params"], str) and d["fold"] in {"train", "dev", "test"}
                and isinstance(d["seed"], int)):
            raise ValueError("wrong types")
        return d
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GameFileError(f"{path} is not a TextWorldExpress game descriptor ({exc}): it needs "
                            f'{{"game": ..., "params": "k=v,...", "fold": "train|dev|test", "seed": N}}') from exc


"""Seeded TextWorld games, generated once in worker processes and cached on disk.

Layout: ``<cache_dir>/<difficulty key>/<seed>/`` holds the compiled game (``game.z8`` plus its
``game.json``) and ``ok.json``, written last, with the SHA-256 of each file. A directory without a
matching ``ok.json`` is a truncated or corrupt entry and is regenerated. A seed that TextWorld cannot
generate or compile gets a ``failed.txt`` with the error, is skipped with a warning, and the pool
moves on to the next seed so it still reaches the requested size.

Training and evaluation seeds are disjoint ranges: train seeds are ``[0, EVAL_SEED_BASE)`` and
evaluation seeds start at ``EVAL_SEED_BASE``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

EVAL_SEED_BASE = 1_000_000
SPLITS = ("train", "eval")
GAME_FILES = ("game.z8", "game.json")
MAX_FAILURES = 16  # more failed seeds than this (or than games asked for) means the settings are broken


@dataclass(frozen=True)
class Difficulty:
    """Generation settings for one difficulty; ``max_steps`` is the episode step limit."""

    name: str
    nb_rooms: int
    nb_objects: int
    quest_length: int
    max_steps: int
    theme: str = "house"

    @property
    def key(self) -> str:
        import textworld

        return (
            f"{self.name}-r{self.nb_rooms}-o{self.nb_objects}-q{self.quest_length}"
            f"-{self.theme}-tw{textworld.__version__}"
        )


DIFFICULTIES = {
    "easy": Difficulty("easy", nb_rooms=2, nb_objects=4, quest_length=1, max_steps=8),
    "medium": Difficulty("medium", nb_rooms=3, nb_objects=4, quest_length=3, max_steps=32),
    "hard": Difficulty("hard", nb_rooms=6, nb_objects=6, quest_length=5, max_steps=32),
}


def default_cache_dir() -> Path:
    """``$TEXTRL_CACHE`` if set, else ``$XDG_CACHE_HOME/textrl`` (``~/.cache/textrl``)."""
    if os.environ.get("TEXTRL_CACHE"):
        return Path(os.environ["TEXTRL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "textrl"


def seed_for(split: str, index: int) -> int:
    """The game seed of the ``index``-th game of a split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if index < 0 or (split == "train" and index >= EVAL_SEED_BASE):
        raise ValueError(f"game index {index} is outside the {split} seed range")
    return index if split == "train" else EVAL_SEED_BASE + index


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_valid_entry(entry: Path) -> bool:
    """True when every game file exists and matches the hash recorded in ``ok.json``."""
    try:
        manifest = json.loads((entry / "ok.json").read_text())
        return all(_sha256(entry / name) == manifest[name] for name in GAME_FILES)
    except (OSError, ValueError, KeyError):
        return False


def _generate(difficulty: Difficulty, seed: int, entry: Path) -> str | None:
    """Worker: generate and compile one game into ``entry``. Returns an error text or None."""
    import textworld
    from textworld.generator import compile_game, make_game

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{seed}-", dir=entry.parent))
    try:
        options = textworld.GameOptions()
        options.seeds = seed
        options.nb_rooms = difficulty.nb_rooms
        options.nb_objects = difficulty.nb_objects
        options.quest_length = difficulty.quest_length
        options.theme = difficulty.theme
        options.path = str(tmp / "game.z8")
        options.force_recompile = True
        compile_game(make_game(options), options)
        manifest = {name: _sha256(tmp / name) for name in GAME_FILES}
        (tmp / "ok.json").write_text(json.dumps(manifest))
        if entry.exists():
            shutil.rmtree(entry)
        os.replace(tmp, entry)  # atomic: readers see a whole entry or none
        return None
    except Exception as exc:  # TextWorld raises many kinds; any of them means "skip this seed"
        shutil.rmtree(tmp, ignore_errors=True)
        if entry.is_dir():
            shutil.rmtree(entry)
        entry.mkdir(parents=True)
        (entry / "failed.txt").write_text(f"{type(exc).__name__}: {exc}")
        return f"{type(exc).__name__}: {exc}"


class GamePool:
    """Compiled games of one difficulty, addressed by split and index.

    >>> pool = GamePool(DIFFICULTIES["easy"])
    >>> paths = pool.games("train", 16)          # generates what is missing, reuses the rest
    """

    def __init__(self, difficulty: Difficulty | str, cache_dir: str | Path | None = None, workers: int = 2):
        if isinstance(difficulty, str):
            if difficulty not in DIFFICULTIES:
                raise ValueError(f"unknown difficulty {difficulty!r}; choose one of {sorted(DIFFICULTIES)}")
            difficulty = DIFFICULTIES[difficulty]
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.difficulty = difficulty
        self.root = Path(cache_dir or default_cache_dir()) / "games" / difficulty.key
        self.workers = workers
        self.generated = 0  # games generated (not loaded from cache) by this pool, for tests and benchmarks

    def entry(self, seed: int) -> Path:
        return self.root / str(seed)

    def games(self, split: str, n: int, start: int = 0) -> list[Path]:
        """Paths of ``n`` playable games of ``split``, from game index ``start`` on.

        Seeds that fail to generate are skipped, so the result may span more than ``n`` seeds.
        """
        seed_for(split, start)  # validates split and start
        indices = range(start, EVAL_SEED_BASE) if split == "train" else itertools.count(start)
        return self.collect((seed_for(split, i) for i in indices), n)

    def collect(self, seeds: Iterable[int], n: int) -> list[Path]:
        """The first ``n`` seeds of ``seeds`` that give a playable game (cached or generated now)."""
        if n < 0:
            raise ValueError(f"number of games must be >= 0, got {n}")
        seeds = iter(seeds)
        found: list[tuple[int, Path]] = []
        failures = 0
        while len(found) < n:
            batch = list(itertools.islice(seeds, n - len(found)))
            if not batch:
                raise RuntimeError(f"ran out of seeds after {len(found)} of {n} {self.difficulty.name} games")
            missing = []
            for seed in batch:
                entry = self.entry(seed)
                if is_valid_entry(entry):
                    found.append((seed, entry / "game.z8"))
                elif (entry / "failed.txt").exists():
                    failures += 1
                    log.warning("skipping %s game seed %d (failed before): %s", self.difficulty.name, seed,
                                (entry / "failed.txt").read_text())
                else:
                    if entry.exists():
                        log.warning("cached game %s is incomplete or corrupt; regenerating it", entry)
                    missing.append(seed)
            for seed, error in zip(missing, self._generate_all(missing)):
                if error is None:
                    found.append((seed, self.entry(seed) / "game.z8"))
                else:
                    failures += 1
                    log.warning("skipping %s game seed %d: %s", self.difficulty.name, seed, error)
            if failures > max(MAX_FAILURES, n):
                raise RuntimeError(
                    f"{failures} {self.difficulty.name} game seeds failed to generate (see the warnings); "
                    f"check the difficulty settings {self.difficulty} and the TextWorld install")
        return [path for _, path in sorted(found)]

    def _generate_all(self, seeds: list[int]) -> list[str | None]:
        if not seeds:
            return []
        self.root.mkdir(parents=True, exist_ok=True)
        jobs = [(self.difficulty, s, self.entry(s)) for s in seeds]
        self.generated += len(seeds)
        if self.workers == 1 or len(seeds) == 1:
            return [_generate(*job) for job in jobs]
        # fork: spawn would re-import the caller's __main__ (breaking unguarded scripts); the children
        # only run TextWorld, never torch, so inheriting the parent's thread pools is harmless.
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=min(self.workers, len(seeds)), mp_context=ctx) as ex:
            return list(ex.map(_generate, *zip(*jobs)))

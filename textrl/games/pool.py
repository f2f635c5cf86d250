"""Seeded games, generated once in worker processes and cached on disk: TextWorld's generator, its
challenge families, and TextWorldExpress games (a small descriptor each, ``textrl.games.express``).

Layout: ``<cache_dir>/games/<GameSpec.key>/<seed>/`` holds the compiled game (``game.z8`` plus its
``game.json``) and ``ok.json``, written last, with the SHA-256 of each file. A directory without a
matching ``ok.json`` is a truncated or corrupt entry and is regenerated. A seed that TextWorld cannot
generate or compile gets a ``failed.txt`` with the error, is skipped with a warning, and the pool
moves on to the next seed so it still reaches the requested size.

Runs may share a cache: each entry is checked and made under a file lock (``<seed>.lock`` beside it),
an entry appears by one rename, and a valid entry is never deleted. An ``OSError`` while making one
(disk full, permissions) raises ``GameCacheError``: it is not the seed's fault, so nothing is recorded.

Training and evaluation seeds are disjoint ranges: train seeds are ``[0, EVAL_SEED_BASE)`` and
evaluation seeds start at ``EVAL_SEED_BASE``.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import textworld
from filelock import FileLock
from textworld_express.version import __version__ as TWX_VERSION

from textrl.config import EnvConfig, TrainConfig, default_cache_dir, load_env_config
from textrl.errors import ConfigError
from textrl.games import express

log = logging.getLogger(__name__)

EVAL_SEED_BASE = 1_000_000
SPLITS = ("train", "eval")
GAME_FILES = ("game.z8", "game.json")
MAX_FAILURES = 16  # more failed seeds than this (or than games asked for) means the settings are broken


CHALLENGES = ("tw-simple", "tw-coin_collector", "tw-treasure_hunter", "tw-cooking")  # TextWorld's own families
# TextWorldExpress's games (textrl.games.express), configured by their engine parameters
EXPRESS = tuple(f"twx-{g}" for g in ("cookingworld", "coin", "twc", "mapreader", "arithmetic", "sorting",
                                     "simonsays", "peckingorder"))
GAMES = ("textworld", *CHALLENGES, *EXPRESS)
_GENERATOR_KEYS = ("rooms", "objects", "quest_length", "theme")  # what game=textworld generates from


class _SettingsParser(argparse.ArgumentParser):
    """A challenge family's own argument parser (the one ``tw-make`` uses), raising instead of exiting."""

    def error(self, message):
        raise ConfigError(f"env.settings of {self.prog}: {message} (its settings: {self.format_usage().strip()}; "
                          f"write them as env.settings.<name>=<value>, booleans as true)")


def challenge_settings(game: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` checked by the family's own argument parser and completed with its defaults."""
    from textworld.challenges import CHALLENGES as REGISTERED  # slow import: only the challenge families need it

    parser = _SettingsParser(prog=game, add_help=False)
    REGISTERED[game][2](parser)
    args = []
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False and value is not None:
            args += [flag, str(value)]
    return vars(parser.parse_args(args))


@dataclass(frozen=True)
class GameSpec:
    """How the games of one setting are made from a seed: TextWorld's generator with rooms, objects,
    quest length and theme (``game="textworld"``), or one of TextWorld's challenge families with its
    complete settings (``eval_settings``: those the eval split's games take instead, where they
    differ). ``max_steps`` is the episode step limit."""

    name: str
    max_steps: int
    game: str = "textworld"
    rooms: int | None = None
    objects: int | None = None
    quest_length: int | None = None
    theme: str | None = None
    settings: tuple[tuple[str, Any], ...] = ()  # a challenge family's settings, defaults filled in
    eval_settings: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_env(cls, env: EnvConfig) -> GameSpec:
        """The spec of an EnvConfig; a ConfigError names a key that does not fit its ``env.game``."""
        if env.game not in GAMES:
            raise ConfigError(f"env.game={env.game!r} is not allowed: one of {list(GAMES)}")
        generator = {key: getattr(env, key) for key in _GENERATOR_KEYS}
        if env.eval_settings and env.game not in CHALLENGES:
            why = ("its train and eval splits already play TextWorldExpress's train and dev folds" if env.game in EXPRESS
                   else "the generator takes no settings")
            raise ConfigError(f"env.eval_settings={dict(env.eval_settings)} is not allowed with env.game={env.game}: "
                              f"{why}; it is for TextWorld's challenge families {list(CHALLENGES)}")
        if env.game == "textworld":
            for key in _GENERATOR_KEYS[:3]:
                if not isinstance(generator[key], int) or generator[key] < 1:
                    raise ConfigError(f"env.{key}={generator[key]!r} is not allowed: an integer >= 1 with env.game=textworld")
            if env.settings:
                raise ConfigError(f"env.settings={dict(env.settings)} is not allowed with env.game=textworld: the "
                                  f"generator takes env.rooms, env.objects, env.quest_length and env.theme")
            return cls(env.name, env.max_steps, **generator)
        given = [key for key, value in generator.items() if value is not None]
        if given:
            raise ConfigError(f"env.{given[0]}={generator[given[0]]!r} is not allowed with env.game={env.game}: "
                              f"set it to null (env.game={env.game} is configured by env.settings)")
        if env.game in EXPRESS:
            if not express.java_available():
                raise ConfigError(f"env.game={env.game}: {express.JAVA_MISSING}")
            settings = dict(env.settings)
            express.check_params(env.game.removeprefix("twx-"), settings)
            return cls(env.name, env.max_steps, env.game, settings=tuple(sorted(settings.items())))
        settings = challenge_settings(env.game, env.settings)
        evaluated = challenge_settings(env.game, {**env.settings, **env.eval_settings})
        return cls(env.name, env.max_steps, env.game, settings=tuple(sorted(settings.items())),
                   eval_settings=tuple(sorted((k, v) for k, v in evaluated.items() if settings[k] != v)))

    @property
    def files(self) -> tuple[str, ...]:
        """The files of one cached game; the first is the one games are opened by."""
        return ("game.twx",) if self.game in EXPRESS else GAME_FILES

    @property
    def key(self) -> str:
        """The cache folder: every setting that changes the games, and TextWorld's version."""
        if self.game == "textworld":
            what = f"r{self.rooms}-o{self.objects}-q{self.quest_length}-{self.theme}"
        elif self.game in EXPRESS:
            return "-".join([self.game, *(f"{k}{v}" for k, v in self.settings), f"twx{TWX_VERSION}"])
        else:
            what = "-".join(k if v is True else f"{k}{v}" for k, v in self.settings if v is not False and v is not None)
            if self.eval_settings:  # the eval split's games differ: a cache of their own
                what += "-eval-" + "-".join(f"{k}{v}" for k, v in self.eval_settings)
        return f"{self.game}-{what}-tw{textworld.__version__}"


def check_games(cfg: TrainConfig) -> None:
    """At start, before anything is built: the games of ``env`` and of each curriculum stage can be
    made (their family and its settings; TextWorldExpress's engine, in Java, judges its own).
    A ConfigError names the key."""
    GameSpec.from_env(cfg.env)
    for stage in cfg.curriculum.stages:
        GameSpec.from_env(load_env_config(stage))


def seed_for(split: str, index: int) -> int:
    """The game seed of the ``index``-th game of a split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if index < 0 or (split == "train" and index >= EVAL_SEED_BASE):
        raise ValueError(f"game index {index} is outside the {split} seed range")
    return index if split == "train" else EVAL_SEED_BASE + index


def game_name(path: str | Path) -> str:
    """A game's short name: its seed for a pool game (``<key>/<seed>/game.z8``), else its file name."""
    path = Path(path)
    return path.parent.name if path.stem == "game" else path.name


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def is_valid_entry(entry: Path, files: tuple[str, ...] = GAME_FILES) -> bool:
    """True when every game file exists and matches the hash recorded in ``ok.json``."""
    try:
        manifest = json.loads((entry / "ok.json").read_text())
        return all(_sha256(entry / name) == manifest[name] for name in files)
    except (OSError, ValueError, KeyError):
        return False


class GameCacheError(OSError):
    """The game cache could not be written or read (disk full, permissions): an error of the machine,
    not of a seed, so no seed is marked as failed."""


def _generate(spec: GameSpec, seed: int, entry: Path, express_seed: int | None = None) -> str | None:
    """Worker: make the game of ``seed`` into ``entry`` unless another run has (a TextWorldExpress
    game: its descriptor, with the engine's ``express_seed``). Returns None, or the error text of a
    seed that cannot be made (recorded in ``failed.txt``); raises GameCacheError on an OSError."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # another run may be making this entry: wait for it, then look again under the lock
        with FileLock(entry.parent / f"{entry.name}.lock"):
            if is_valid_entry(entry, spec.files):
                return None
            if (entry / "failed.txt").is_file():
                return (entry / "failed.txt").read_text()
            return _make_entry(spec, seed, entry, express_seed)
    except OSError as exc:
        raise GameCacheError(f"cannot make the game cache entry {entry} ({type(exc).__name__}: {exc}); "
                             f"seed {seed} is not marked as failed (the machine's fault, not the seed's): fix "
                             f"the cause (disk space, permissions of {entry.parent}), then run again") from exc


def _make_entry(spec: GameSpec, seed: int, entry: Path, express_seed: int | None) -> str | None:
    """Under the entry's lock: generate into a temporary folder, then rename it over the (invalid or
    missing) entry, a game or a ``failed.txt`` alike. Returns what ``_generate`` returns."""
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{seed}-", dir=entry.parent))
    try:
        error = _make_game(spec, seed, tmp, express_seed)
        if error is None:
            manifest = {name: _sha256(tmp / name) for name in spec.files}
            (tmp / "ok.json").write_text(json.dumps(manifest))
        else:
            shutil.rmtree(tmp)
            tmp.mkdir()
            (tmp / "failed.txt").write_text(error)
        if entry.exists():  # invalid: a valid one was returned under the lock
            shutil.rmtree(entry)
        os.replace(tmp, entry)  # atomic: readers see a whole entry or none
        return error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; left by an error before it


def _make_game(spec: GameSpec, seed: int, folder: Path, express_seed: int | None) -> str | None:
    """Generate and compile one game into ``folder``. Returns None, or the error text of a seed that
    cannot be made; an OSError is raised (the machine's fault, not the seed's)."""
    # slow imports (the generator, the families): only generating games needs them
    from textworld.challenges import CHALLENGES as REGISTERED
    from textworld.generator import compile_game, make_game

    try:
        options = textworld.GameOptions()
        options.seeds = seed
        options.path = str(folder / "game.z8")
        options.force_recompile = True
        if spec.game in EXPRESS:
            split = "train" if seed < EVAL_SEED_BASE else "eval"
            if express_seed is None:
                raise ValueError(f"TextWorldExpress's fold for textrl's {split} split has no game left for seed {seed}")
            express.write_descriptor(folder / "game.twx", spec.game.removeprefix("twx-"), dict(spec.settings), split,
                                     express_seed)
        else:
            if spec.game == "textworld":
                options.nb_rooms, options.nb_objects = spec.rooms, spec.objects
                options.quest_length, options.theme = spec.quest_length, spec.theme
                game = make_game(options)
            else:
                settings = dict(spec.settings)
                if seed >= EVAL_SEED_BASE:
                    settings.update(spec.eval_settings)
                game = REGISTERED[spec.game][1](settings, options)
            compile_game(game, options)
        return None
    except OSError:
        raise
    except Exception as exc:  # TextWorld raises many kinds; any of them means "skip this seed"
        return f"{type(exc).__name__}: {exc}"


def start_method(cuda_initialized: bool | None = None) -> str:
    """How game-generation workers start: ``fork``, unless this process has initialised CUDA
    (``cuda_initialized``; None: ask torch, if it is imported at all), then ``spawn``.

    Fork is the default because spawn re-imports the caller's ``__main__`` in every worker (breaking
    scripts without an ``if __name__ == "__main__"`` guard), and the children only run TextWorld, never
    torch, so inheriting the parent's thread pools is harmless. Forking a process whose CUDA driver
    threads are live is not: a child can inherit a lock another thread held and deadlock. ``train``
    generates every game before anything touches CUDA; this covers what runs later (textrl-eval of a
    QLoRA checkpoint, whose model bitsandbytes places on the GPU as it loads, a caller's own code)."""
    if cuda_initialized is None:
        torch = sys.modules.get("torch")  # not imported: CUDA cannot be initialised by it
        cuda_initialized = torch is not None and torch.cuda.is_initialized()
    return "spawn" if cuda_initialized else "fork"


class GamePool:
    """Compiled games of one setting, addressed by split and index.

    >>> pool = GamePool("easy")                  # an env option's name, or a GameSpec
    >>> paths = pool.games("train", 16)          # generates what is missing, reuses the rest
    """

    def __init__(self, spec: GameSpec | str, cache_dir: str | Path | None = None, workers: int = 2):
        if isinstance(spec, str):
            spec = GameSpec.from_env(load_env_config(spec))
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.spec = spec
        self.root = Path(cache_dir or default_cache_dir()) / "games" / spec.key
        self.workers = workers
        self.generated = 0  # games not in the cache when asked (made here or by a run beside it), for tests
        self._fold_seeds: dict[str, list[int]] = {}  # TextWorldExpress: the engine's seeds of each fold

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
                raise RuntimeError(f"ran out of seeds after {len(found)} of {n} {self.spec.name} games")
            missing = []
            for seed in batch:
                entry = self.entry(seed)
                if is_valid_entry(entry, self.spec.files):
                    found.append((seed, entry / self.spec.files[0]))
                elif (entry / "failed.txt").exists():
                    failures += 1
                    log.warning("skipping %s game seed %d (failed before): %s", self.spec.name, seed,
                                (entry / "failed.txt").read_text())
                else:
                    if entry.exists():
                        log.warning("cached game %s is incomplete or corrupt; regenerating it", entry)
                    missing.append(seed)
            for seed, error in zip(missing, self._generate_all(missing)):
                if error is None:
                    found.append((seed, self.entry(seed) / self.spec.files[0]))
                else:
                    failures += 1
                    log.warning("skipping %s game seed %d: %s", self.spec.name, seed, error)
            if failures > max(MAX_FAILURES, n):
                raise RuntimeError(
                    f"{failures} {self.spec.name} game seeds failed to generate (see the warnings); "
                    f"check the settings {self.spec} and the TextWorld install")
        return [path for _, path in sorted(found)]

    def _generate_all(self, seeds: list[int]) -> list[str | None]:
        if not seeds:
            return []
        self.root.mkdir(parents=True, exist_ok=True)
        self.generated += len(seeds)
        workers = 1 if self.spec.game in EXPRESS else min(self.workers, len(seeds))
        method = start_method() if workers > 1 else None
        log.info("generating %d %s games (seeds %d..%d) %s", len(seeds), self.spec.name, min(seeds), max(seeds),
                 f"in {workers} worker processes ({method})" if method else "in this process")
        if self.spec.game in EXPRESS:  # a descriptor per game: nothing to spread over workers
            return [_generate(self.spec, s, self.entry(s), self._express_seed(s)) for s in seeds]
        jobs = [(self.spec, s, self.entry(s)) for s in seeds]
        if method is None:
            return [_generate(*job) for job in jobs]
        ctx = multiprocessing.get_context(method)
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
            return list(ex.map(_generate, *zip(*jobs)))

    def _express_seed(self, seed: int) -> int | None:
        """The engine seed of textrl game ``seed``: the n-th valid seed of the split's fold."""
        split, index = ("train", seed) if seed < EVAL_SEED_BASE else ("eval", seed - EVAL_SEED_BASE)
        if split not in self._fold_seeds:
            game = self.spec.game.removeprefix("twx-")
            self._fold_seeds[split] = express.fold_seeds(game, dict(self.spec.settings), split)
        seeds = self._fold_seeds[split]
        return seeds[index] if index < len(seeds) else None

"""Runs sharing the game and model caches: the check and the making of an entry happen under a file
lock, a valid entry is never deleted, and an OSError is an error of the machine, not a failed seed."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import multiprocessing
import os
import re
import threading
import time
import traceback
from pathlib import Path

import pytest
from textworld.generator.game import Game

from textrl.config import load_model_config
from textrl.games.pool import GameCacheError, GamePool, is_valid_entry
from textrl.policy.model import _converted_gguf, conversion_lock, model_cache_dir

GAMES = 3


def _pool_in_a_process(cache_dir, start, rendezvous, results):
    """One run: generate the first GAMES easy training games into ``cache_dir``. Its first rename of an
    entry waits (2 s at most) for the other run's: without a lock both runs then make the same entry
    at once, as two runs started together do by chance."""
    try:
        root = GamePool("easy", cache_dir=cache_dir).root
        rename = os.replace

        def replace(src, dst, *args, **kwargs):
            if Path(dst).parent == root and not rendezvous.broken:
                try:
                    rendezvous.wait(timeout=2)
                except threading.BrokenBarrierError:
                    pass  # the other run is not renaming an entry now (it waits for the lock)
            return rename(src, dst, *args, **kwargs)

        os.replace = replace  # this forked child's only
        start.wait(timeout=60)
        paths = GamePool("easy", cache_dir=cache_dir, workers=1).games("train", GAMES)
        results.put([(p.parent.name, {f.name: hashlib.sha256(f.read_bytes()).hexdigest()
                                      for f in sorted(p.parent.iterdir())}) for p in paths])
    except BaseException:
        results.put(traceback.format_exc())


def test_two_runs_generating_one_pool_at_once_get_the_same_games_and_fail_no_seed(tmp_path):
    ctx = multiprocessing.get_context("fork")
    start, rendezvous, results = ctx.Barrier(2), ctx.Barrier(2), ctx.Queue()
    runs = [ctx.Process(target=_pool_in_a_process, args=(tmp_path, start, rendezvous, results)) for _ in range(2)]
    for run in runs:
        run.start()
    got = [results.get(timeout=120) for _ in runs]
    for run in runs:
        run.join(timeout=30)
    assert all(isinstance(g, list) for g in got), "\n".join(g for g in got if isinstance(g, str))
    assert got[0] == got[1]  # the same seeds, the same files, the same hashes
    assert [seed for seed, _ in got[0]] == [str(i) for i in range(GAMES)]  # no seed skipped
    root = GamePool("easy", cache_dir=tmp_path).root
    assert not list(root.rglob("failed.txt"))
    assert all(is_valid_entry(root / seed) for seed, _ in got[0])


def test_a_write_error_during_generation_raises_naming_the_entry_and_marks_no_seed_failed(tmp_path, monkeypatch):
    """Disk full while TextWorld writes the game: an error naming the cache entry; the seed is not
    recorded as failed, and the next run (disk freed) makes that very game."""
    save = Game.save
    calls = []

    def full_disk(self, filename):
        calls.append(filename)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return save(self, filename)

    monkeypatch.setattr(Game, "save", full_disk)
    pool = GamePool("easy", cache_dir=tmp_path, workers=1)
    entry = pool.entry(5)
    with pytest.raises(GameCacheError, match=f"cannot make the game cache entry {re.escape(str(entry))} .*No space "
                                             f"left on device.*seed 5 is not marked as failed"):
        pool.collect(iter([5, 6]), 1)
    assert not list(tmp_path.rglob("failed.txt")) and not entry.exists()
    assert not [p for p in pool.root.iterdir() if p.name.startswith(".tmp-")]  # no half-made entry left
    assert isinstance(GameCacheError("x"), OSError)  # callers that catch OSError still do

    assert pool.collect(iter([5, 6]), 1) == [entry / "game.z8"]
    assert is_valid_entry(entry)


def test_a_run_waiting_for_the_model_conversion_lock_takes_the_other_runs_copy(tmp_path):
    """While one run converts the GGUF model (its lock held), another waits, then finds the copy and
    converts nothing (this model's GGUF package does not exist: converting would raise)."""
    cfg = dataclasses.replace(load_model_config("smollm2"), name="shared", gguf_package="textrl_no_such_package")
    target = model_cache_dir(tmp_path) / cfg.name
    target.parent.mkdir(parents=True)
    got = []
    with conversion_lock(target):  # the other run, converting
        waiter = threading.Thread(target=lambda: got.append(_try(_converted_gguf, cfg, tmp_path)))
        waiter.start()
        time.sleep(0.5)
        assert not got  # still waiting for the lock
        tmp = target.with_name(".shared-tmp")
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"weights")
        os.replace(tmp, target)
    waiter.join(timeout=30)
    assert got == [target]
    assert (target / "model.safetensors").read_bytes() == b"weights"


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        return exc

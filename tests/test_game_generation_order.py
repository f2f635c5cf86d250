"""Every game a run plays is made at its start, before anything touches CUDA (issue 31, item 13).

Game generation forks worker processes (textrl/games/pool.py); forking a process whose CUDA threads
are live can deadlock. The warm start moved the policy to the GPU before generating its games, and a
curriculum stage's games were made when the stage began. Here a run with a warm start and two
curriculum stages (each unlike env, whose games the warm start and the evaluation play) starts on an
empty game cache: every cache entry must exist before train() says its games are ready (the cache
files' times against the log record's), and GamePool generates nothing after that line, through the
warm start, two iterations and a stage move. Real games, real generation; nothing mocked.
"""

import logging
import os
from pathlib import Path

import torch

import textrl.cli.train as cli
from tests.conftest import config, read_metrics
from textrl.config import default_cache_dir


def test_every_game_of_a_run_is_made_before_the_policy_is_built(tmp_path, caplog):
    cache = tmp_path / "cache"
    cache.mkdir()
    models = default_cache_dir() / "models"
    if models.is_dir():  # the converted SmolLM2 tokenizer: only the games start empty
        (cache / "models").symlink_to(models)
    cfg = config(tmp_path / "run", f"cache_dir={cache}", "iterations=2", "eval.every=2", "eval.before_training=false",
                 "eval.transcripts=0", "curriculum.stages=[tw_coin,tw_simple]", "curriculum.threshold=0",
                 "curriculum.window=1", "env.max_steps=4", "warm_start.steps=1", "warm_start.games=4",
                 "warm_start.batch=2")
    caplog.set_level(logging.INFO)
    cli.train(cfg)

    records = caplog.records
    ready = next(i for i, r in enumerate(records) if r.getMessage().startswith("games ready"))
    made = [i for i, r in enumerate(records) if r.name == "textrl.games.pool" and r.getMessage().startswith("generating")]
    assert made and max(made) < ready, [records[i].getMessage() for i in made if i > ready]
    # the policy is built after the games: Lightning's seed line comes right before build_policy
    seeded = next(i for i, r in enumerate(records) if r.getMessage().startswith("Seed set to"))
    assert ready < seeded

    entries = [e for e in (cache / "games").glob("*/*") if e.is_dir()]
    kinds = {e.parent.name.split("-")[0] + "-" + e.parent.name.split("-")[1] for e in entries}
    assert kinds == {"textworld-r2", "tw-coin_collector", "tw-simple"}  # env (easy), both stages
    easy = {int(e.name) for e in entries if e.parent.name.startswith("textworld-r2")}
    assert {0, 1, 2, 3} <= easy and {1_000_000, 1_000_001, 1_000_002, 1_000_003} <= easy  # warm start, evaluation
    newest = max(f.stat().st_mtime for e in entries for f in e.iterdir())
    assert newest <= records[ready].created

    rows = [r for r in read_metrics(tmp_path / "run") if r.get("curriculum/stage")]
    assert [float(r["curriculum/stage"]) for r in rows] == [0.0, 1.0]  # the second stage was played
    assert not torch.cuda.is_initialized()


def test_generation_workers_are_forked_unless_cuda_is_initialised(tmp_path, monkeypatch, caplog):
    """Fork by default (no ``__main__`` re-import); spawn where this process has initialised CUDA,
    checked here by generating real games in spawned workers (torch is asked, and answers yes)."""
    from textrl.games.pool import GamePool, is_valid_entry, start_method

    assert start_method(False) == "fork" and start_method(True) == "spawn"
    assert start_method() == "fork"  # CUDA untouched in this process
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert start_method() == "spawn"
    caplog.set_level(logging.INFO, logger="textrl.games.pool")
    pool = GamePool("tw_coin", cache_dir=tmp_path, workers=2)
    games = pool.games("train", 2)
    assert "generating 2 tw_coin games (seeds 0..1) in 2 worker processes (spawn)" in caplog.text
    assert len(games) == 2 and all(is_valid_entry(Path(g).parent) for g in games)
    assert all(os.path.getsize(g) > 0 for g in games)

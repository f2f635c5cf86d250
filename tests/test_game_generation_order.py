"""Every game a run plays is made at its start, before anything touches CUDA (issue 31, item 13).

Game generation forks worker processes (textrl/games/pool.py); forking a process whose CUDA threads
are live can deadlock. The warm start moved the policy to the GPU before generating its games, and a
curriculum stage's games were made when the stage began. Here a run with a warm start and two
curriculum stages (each unlike env, whose games the warm start and the evaluation play) starts on an
empty game cache: every cache entry's files must be older than the policy (the log record of the
seed set right before it is built), and GamePool must generate nothing after train() says its games
are ready, through the warm start, two iterations and a stage move. Real games, real generation.
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
                 "curriculum.window=1", "env.max_steps=4", "env.num_envs=2", "env.pool_size=2", "env.decode_groups=1",
                 "eval.games=2", "eval.batch=2", "eval.train_games=0", "warm_start.steps=1", "warm_start.games=3",
                 "warm_start.batch=2")
    caplog.set_level(logging.INFO)
    cli.train(cfg)

    records = caplog.records
    # the policy is built right after Lightning's seed line (L.seed_everything, then build_policy):
    # every game file in the cache is older than it
    seeded = next(r for r in records if r.getMessage().startswith("Seed set to"))
    entries = [e for e in (cache / "games").glob("*/*") if e.is_dir()]
    newest = max(entries, key=lambda e: max(f.stat().st_mtime for f in e.iterdir()))
    assert max(f.stat().st_mtime for f in newest.iterdir()) <= seeded.created, f"{newest} made after the start"
    kinds = {"-".join(e.parent.name.split("-")[:2]) for e in entries}
    assert kinds == {"textworld-r2", "tw-coin_collector", "tw-simple"}  # env (easy), both stages
    easy = {int(e.name) for e in entries if e.parent.name.startswith("textworld-r2")}
    assert easy == {0, 1, 2, 1_000_000, 1_000_001}  # the warm start's, the evaluation's
    # and GamePool generated nothing after train() said the games were ready (before the seed line)
    ready = next(i for i, r in enumerate(records) if r.getMessage().startswith("games ready"))
    made = [i for i, r in enumerate(records) if r.name == "textrl.games.pool" and r.getMessage().startswith("generating")]
    assert made and max(made) < ready < records.index(seeded), [records[i].getMessage() for i in made if i > ready]

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

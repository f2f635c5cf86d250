import logging

import pytest

from textrl.config import load_env_config
from textrl.games.pool import EVAL_SEED_BASE, GamePool, GameSpec, is_valid_entry, seed_for


def test_cache_hit_does_not_regenerate(tmp_path):
    pool = GamePool("easy", cache_dir=tmp_path)
    first = pool.games("train", 3)
    assert pool.generated == 3 and all(p.is_file() for p in first)
    mtimes = [p.stat().st_mtime_ns for p in first]

    again = GamePool("easy", cache_dir=tmp_path)
    assert again.games("train", 3) == first
    assert again.generated == 0
    assert [p.stat().st_mtime_ns for p in first] == mtimes


def test_corrupt_or_truncated_cache_file_is_regenerated(tmp_path, caplog):
    pool = GamePool("easy", cache_dir=tmp_path)
    games = pool.games("train", 2)
    original = games[0].read_bytes()
    games[0].write_bytes(original[: len(original) // 2])  # truncated z8
    (games[1].parent / "game.json").write_text("{not json")  # corrupt json
    assert not is_valid_entry(games[0].parent) and not is_valid_entry(games[1].parent)

    again = GamePool("easy", cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        regenerated = again.games("train", 2)
    assert again.generated == 2
    assert regenerated == games
    assert games[0].read_bytes() == original  # same seed, same game
    assert all(is_valid_entry(p.parent) for p in regenerated)
    assert "corrupt" in caplog.text


def test_failing_seed_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    pool = GamePool("easy", cache_dir=tmp_path)
    bad = 2**32  # TextWorld's random generator rejects seeds >= 2**32: a real generation failure
    with caplog.at_level(logging.WARNING):
        games = pool.collect(iter([7, bad, 8, 9]), 3)
    assert [p.parent.name for p in games] == ["7", "8", "9"]  # still reaches the requested size
    assert str(bad) in caplog.text
    assert (tmp_path / "games" / pool.spec.key / str(bad) / "failed.txt").is_file()
    # remembered: the next pool skips it without trying again
    again = GamePool("easy", cache_dir=tmp_path)
    assert again.collect(iter([bad, 7]), 1) == games[:1] and again.generated == 0


def test_train_and_eval_seeds_never_overlap(easy_pool):
    train = {seed_for("train", i) for i in range(0, EVAL_SEED_BASE, 997)} | {seed_for("train", EVAL_SEED_BASE - 1)}
    evals = {seed_for("eval", i) for i in range(0, 10**6, 997)}
    assert not train & evals
    with pytest.raises(ValueError):
        seed_for("train", EVAL_SEED_BASE)  # the train range ends where eval begins
    with pytest.raises(ValueError):
        seed_for("test", 0)
    train_games = set(easy_pool.games("train", 8))
    eval_games = set(easy_pool.games("eval", 8))
    assert not train_games & eval_games


def test_generated_games_match_the_difficulty(easy_games):
    import textworld

    easy = load_env_config("easy")
    for path in easy_games[:4]:
        game = textworld.Game.load(str(path.with_suffix(".json")))
        assert len(game.world.rooms) == easy.rooms
        assert len(game.walkthrough) == easy.quest_length
    assert len(set(easy_games)) == 24


def test_bad_arguments_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown env 'impossible'"):
        GamePool("impossible", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="workers"):
        GamePool("easy", cache_dir=tmp_path, workers=0)

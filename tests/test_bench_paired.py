"""bench/paired.py: the game-by-game comparison of two evaluations of the same held-out games."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from paired import compare, sign_test  # noqa: E402  (bench/ is a script directory, not a package)


def evaluation(path: Path, games: list[tuple[str, bool, int]]) -> Path:
    path.write_text(json.dumps({"per_game": [{"game": g, "won": w, "steps": s} for g, w, s in games]}))
    return path


def test_the_sign_test_is_the_exact_binomial_tail():
    assert sign_test(0, 0) == 1.0
    assert sign_test(5, 0) == pytest.approx(2 / 32)
    assert sign_test(7, 1) == pytest.approx(2 * (1 + 8) / 256)  # 7 lost->won, 1 won->lost (easy, issue 68)
    assert sign_test(1, 7) == sign_test(7, 1) and sign_test(3, 3) == 1.0


def test_pairs_pool_the_discordant_games_and_the_step_changes(tmp_path):
    a = evaluation(tmp_path / "a.json", [("g1", False, 32), ("g2", True, 4), ("g3", True, 6)])
    b = evaluation(tmp_path / "b.json", [("g3", True, 4), ("g2", True, 4), ("g1", True, 5)])  # any order
    c = evaluation(tmp_path / "c.json", [("g1", True, 5), ("g2", False, 32), ("g3", True, 6)])
    r = compare([(a, b), (a, c)])
    assert (r["games"], r["gained"], r["lost"]) == (6, 2, 1)
    assert r["sign_test_p"] == pytest.approx(1.0)
    diffs = [-27, 0, -2, -27, 28, 0]
    assert r["steps_change"]["mean"] == pytest.approx(sum(diffs) / 6)
    lo, hi = r["steps_change"]["ci95"]
    assert lo < r["steps_change"]["mean"] < hi and not math.isinf(hi)
    assert r["pairs"][0]["wins_before"] == pytest.approx(2 / 3) and r["pairs"][0]["wins_after"] == 1.0


def test_evaluations_of_different_games_are_refused(tmp_path):
    a = evaluation(tmp_path / "a.json", [("g1", True, 3)])
    b = evaluation(tmp_path / "b.json", [("g2", True, 3)])
    with pytest.raises(SystemExit, match="played different games"):
        compare([(a, b)])

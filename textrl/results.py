"""What a set of played episodes adds up to: win rate, steps and return with 95% intervals, how the
games not won failed (``textrl.failures``), and every game. ``textrl-eval`` writes it as
``results.json``; training writes the same for each evaluation (``evaluation/iter_<k>.json``), so a
run's final evaluation need not be played again."""

from __future__ import annotations

import math
import statistics

from textrl.failures import failure_counts
from textrl.games.pool import game_name
from textrl.rollout import Episode

Z95 = 1.959964  # two-sided 95% normal quantile


def wilson_interval(wins: int, n: int) -> list[float]:
    """95% Wilson score interval of a win rate: stays inside [0, 1] and is sensible at 0 or n wins."""
    if n == 0:
        return [0.0, 1.0]
    p = wins / n
    centre = (p + Z95**2 / (2 * n)) / (1 + Z95**2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95**2 / (4 * n * n)) / (1 + Z95**2 / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def mean_interval(values: list[float]) -> list[float]:
    """95% normal interval of a mean (mean +- 1.96 standard errors)."""
    mean = statistics.fmean(values)
    half = Z95 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return [mean - half, mean + half]


def summarize(episodes: list[Episode]) -> dict:
    """Win rate, steps and return over the played episodes; an episode a game fault aborted
    (``Episode.aborted``) is counted apart, not as a loss."""
    aborted = [e for e in episodes if e.aborted is not None]
    episodes = [e for e in episodes if e.aborted is None]
    if not episodes:
        raise ValueError(f"all {len(aborted)} games were aborted by game faults (see the log)")
    wins = sum(e.won for e in episodes)
    steps = [float(e.length) for e in episodes]
    returns = [e.total_return for e in episodes]
    return {
        "games": len(episodes),
        "aborted": [{"game": game_name(e.game), "reason": e.aborted} for e in aborted],
        "win_rate": {"mean": wins / len(episodes), "ci95": wilson_interval(wins, len(episodes))},
        "steps": {"mean": statistics.fmean(steps), "ci95": mean_interval(steps)},
        "return": {"mean": statistics.fmean(returns), "ci95": mean_interval(returns)},
        "failures": failure_counts(episodes),  # games not won, by how they failed (textrl.failures)
        "per_game": [{"game": game_name(e.game), "won": e.won, "steps": e.length,
                      "return": round(e.total_return, 6)} for e in episodes],
    }

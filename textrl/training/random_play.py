"""Wins found by uniformly random play, loops erased: what the warm start clones for RL alone.

``warm_start.source=random_play`` replaces the games' walkthroughs with wins the agent finds itself,
from the games' score only (nothing a game ships): each training game is played with a uniformly
random admissible command every turn, up to ``warm_start.tries`` episodes, until one wins. The win's
loops are erased (``loop_erased``): where it came back to a state it had shown before
(``Observation.state``: the room description and the inventory), the commands in between are cut.
The state shown is not the whole world (a container elsewhere may have changed), so the shorter list
is replayed, and kept only if it still wins; a win whose erased list does not win is dropped, as a
walkthrough that does not win is, rather than cloning its loops. This is Go-Explore's recipe
(Ecoffet et al., 2021: explore, return to what worked, then make it robust by imitation and RL) with
self-imitation's loop erasure (Oh et al., 2018), on a simulator that resets: exploration is the
random policy, and the cloned list is then the policy PPO improves.

Each game's random play draws from its own generator, seeded by the run's seed and the game's name,
so a game is explored the same way whichever games are explored beside it.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from textrl.config import TrainConfig
from textrl.games.env import Game, GameFault, open_game
from textrl.games.pool import game_name
from textrl.games.prompt import PromptBuilder
from textrl.rollout import Episode, replay_commands

log = logging.getLogger(__name__)


@dataclass
class Found:
    """One game's exploration: its first win, loops erased and replayed as the turns a rollout would
    record (None: no win in ``tries`` episodes, or an erased list that does not win), the episodes
    played, and the turns of the win as played (0: none)."""

    episode: Episode | None
    episodes: int
    played: int = 0


def random_win(game: Game, rng: random.Random, tries: int) -> tuple[list[str], list[tuple[str, str]], int] | None:
    """Up to ``tries`` episodes of uniformly random play; the first win's commands, the state each
    was played from, and the episodes played (None: no win in ``tries``)."""
    for episode in range(1, tries + 1):
        obs = game.reset()
        commands, states = [], []
        while obs.admissible_commands:
            command = rng.choice(obs.admissible_commands)
            commands.append(command)
            states.append(obs.state)
            result = game.step(command)
            obs = result.observation
            if obs.won:
                return commands, states, episode
            if result.done:
                break
    return None


def loop_erased(commands: list[str], states: list[tuple[str, str]]) -> list[str]:
    """``commands`` with every loop cut out: walking the turns, a return to a state already on the
    path drops the path back to where that state was first seen."""
    path: list[tuple[tuple[str, str], str]] = []
    place: dict[tuple[str, str], int] = {}  # state -> its place on the path
    for state, command in zip(states, commands):
        if state in place:  # back where it was: what it did since is a loop
            k = place[state]
            for cut, _ in path[k:]:
                del place[cut]
            del path[k:]
        place[state] = len(path)
        path.append((state, command))
    return [command for _, command in path]


def explore(game_file: Path, env, prompts: PromptBuilder, seed: int, tries: int) -> Found:
    """``game_file`` explored (module docstring); the game is opened and closed here."""
    rng = random.Random(f"{seed}/{game_name(game_file)}")
    game = open_game(game_file, env)
    try:
        found = random_win(game, rng, tries)
        if found is None:
            return Found(None, tries)
        commands, states, episodes = found
        episode = replay_commands(game, prompts, loop_erased(commands, states))
        return Found(episode if episode.won else None, episodes, len(commands))
    finally:
        game.close()


def random_play_episodes(games: list[Path], prompts: PromptBuilder,
                         cfg: TrainConfig) -> tuple[list[Episode], list[str], dict[str, float]]:
    """Each game's first win by uniformly random play, loops erased (module docstring),
    as an episode of forced actions; (the wins kept, the games with none, the exploration's figures)."""
    started = time.perf_counter()
    found, faults = [], 0
    for game in games:
        try:
            found.append(explore(game, cfg.env, prompts, cfg.seed, cfg.warm_start.tries))
        except GameFault as fault:  # a fault costs this game's wins, not the run
            log.warning("warm start: random play skips a game: %s", fault)
            found.append(Found(None, 0))
            faults += 1
    kept = [f.episode for f in found if f.episode is not None]
    skipped = [str(game) for game, f in zip(games, found) if f.episode is None]
    won = [f for f in found if f.played]
    figures = {
        "warm_start/random_wins": float(len(kept)),  # the wins cloned
        "warm_start/random_episodes": float(sum(f.episodes for f in found)),  # episodes of random play
        # turns of the first wins as played, and of the cloned ones after loop erasure
        "warm_start/random_win_turns": sum(f.played for f in won) / max(len(won), 1),
        "warm_start/cloned_turns": sum(e.length for e in kept) / max(len(kept), 1),
        "warm_start/random_play_seconds": time.perf_counter() - started,
        "warm_start/random_play_faults": float(faults),  # games skipped for an engine fault
    }
    log.info("warm start: random play won %d of %d training games in %d episodes (%d turns a win as played, %.1f "
             "after loop erasure; %d wins whose erased list did not win dropped), %.0f s", len(won), len(games),
             figures["warm_start/random_episodes"], figures["warm_start/random_win_turns"],
             figures["warm_start/cloned_turns"], len(won) - len(kept), figures["warm_start/random_play_seconds"])
    return kept, skipped, figures

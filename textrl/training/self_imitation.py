"""Self-imitation: behaviour cloning on the policy's own shortest wins (``self_imitation``).

RL alone finds wins by exploration long before its greedy policy plays them: on medium the sampled
rollouts win far more games than the greedy policy of the same weights, which loops (docs/results.md).
Cloning the walkthroughs is what has moved medium. This is the same cloning, on the wins the
rollouts found themselves: rewards from the games' score only, no walkthrough, after Oh et al.'s
self-imitation learning (2018), with its filter "return above the value estimate" reduced to "the
episode won".

``WinMemory`` keeps, for each training game the rollouts won, its shortest winning command list so
far, loops erased (``loop_erased``): where the episode came back to a state it had been in
(``Observation.state``: room description and inventory), the commands in between are cut, if the
shorter list still wins when replayed (the state shown is not the whole world: a cut that drops a
command with an effect elsewhere does not win, and the list as played is kept). Cloned as played,
a win found after ten turns of ``go east`` / ``go west`` would teach the loop.

Each iteration, after the PPO update, ``SelfImitation.run`` replays ``self_imitation.episodes``
remembered wins (drawn by (seed, iteration); with several ranks, each replays and clones its share
of the draw) as forced actions (``replay_commands``), and the LM takes one pass of cross-entropy
steps on their decisions (``PPOUpdate.imitate``). Every rank holds the same memory (what each rank
won, and which of its replays no longer won, are gathered), which checkpoints keep: a resumed run
clones what the uninterrupted one would have.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Callable

from textrl.config import EnvConfig, SelfImitationConfig
from textrl.errors import GameFileError
from textrl.games.env import open_game
from textrl.games.prompt import PromptBuilder
from textrl.rollout import Episode, replay_commands

log = logging.getLogger(__name__)


def loop_erased(episode: Episode) -> list[str]:
    """The episode's commands with every loop cut out: walking its turns, a return to a state
    already on the path drops the path back to where that state was first seen."""
    path: list[tuple[tuple[str, str], str]] = []
    seen: dict[tuple[str, str], int] = {}  # state -> its place on the path
    for step in episode.steps:
        state = step.observation.state
        if state in seen:  # back where it was: what it did since is a loop
            k = seen[state]
            for s, _ in path[k:]:
                del seen[s]
            del path[k:]
        seen[state] = len(path)
        path.append((state, step.action.command))
    return [command for _, command in path]


class WinMemory:
    """Each remembered training game's shortest winning command list, the least recently won first;
    at most ``size`` games."""

    def __init__(self, size: int):
        self.size = size
        self.wins: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self.wins)

    def record(self, game: str, commands: list[str]) -> None:
        """A win of ``game`` with ``commands``: kept if the game has none as short; the game becomes
        the most recently won either way."""
        old = self.wins.pop(game, None)
        self.wins[game] = commands if old is None or len(commands) < len(old) else old
        for stale in list(self.wins)[: max(0, len(self.wins) - self.size)]:
            del self.wins[stale]

    def forget(self, game: str) -> None:
        self.wins.pop(game, None)

    def keep_only(self, games: set[str]) -> None:
        """Forget every game not in ``games`` (the current training pool: a curriculum stage's games
        go when it moves on, and a checkpoint names no game to open)."""
        self.wins = {g: c for g, c in self.wins.items() if g in games}

    def draw(self, rng: random.Random, n: int) -> list[tuple[str, list[str]]]:
        """Up to ``n`` remembered games, without repeats, in the draw's order."""
        games = rng.sample(sorted(self.wins), min(n, len(self.wins)))
        return [(g, self.wins[g]) for g in games]

    def state_dict(self) -> dict:
        return {"wins": [[g, c] for g, c in self.wins.items()]}

    def load_state_dict(self, state: dict) -> None:
        wins = [(str(g), [str(c) for c in commands]) for g, commands in state["wins"]]
        self.wins = dict(wins[max(0, len(wins) - self.size):])  # the most recently won, up to this size


class SelfImitation:
    """The memory of wins and what one iteration does with it (module docstring)."""

    def __init__(self, cfg: SelfImitationConfig, seed: int, tokenizer,
                 gather: Callable[[list], list] = lambda mine: mine):
        self.cfg, self.seed, self.tokenizer = cfg, seed, tokenizer
        self.gather = gather  # every rank's list, concatenated in rank order (one process: its own)
        self.memory = WinMemory(cfg.games)

    def replay(self, game: str, commands: list[str], env: EnvConfig) -> Episode | None:
        """``commands`` replayed in ``game``, shown as ``env``'s rollouts are (None where the game
        faults: it costs that game's memory, not the run)."""
        try:
            handle = open_game(game, env)
            try:
                return replay_commands(handle, PromptBuilder.for_env(self.tokenizer, env), commands)
            finally:
                handle.close()
        except GameFileError as fault:  # GameFault included
            log.warning("self-imitation: %s could not be replayed and is forgotten: %s", game, fault)
            return None

    def shortest(self, episode: Episode, env: EnvConfig) -> tuple[list[str], int]:
        """A won episode's commands, loops erased where the shorter list still wins; and the turns cut.
        No replay where the memory already holds a list as short (``record`` would keep that one)."""
        commands = [s.action.command for s in episode.steps]
        erased = loop_erased(episode)
        known = self.memory.wins.get(episode.game)
        if len(erased) < len(commands) and (known is None or len(erased) < len(known)):
            shorter = self.replay(episode.game, erased, env)
            if shorter is not None and shorter.won:  # (it may win before its last command)
                return erased[: shorter.length], len(commands) - shorter.length
        return commands, 0

    def run(self, episodes: list[Episode], iteration: int, env: EnvConfig, pool: list[Path],
            imitate: Callable[[list[Episode]], dict[str, float]], share: slice = slice(None)) -> dict[str, float]:
        """One iteration, after the PPO update: remember the wins among ``episodes`` (every rank's,
        gathered in rank order), replay this rank's ``share`` of the iteration's draw, forget on every
        rank the games whose replay no longer won on any, and clone (``imitate``:
        ``PPOUpdate.imitate``). Returns ``imitation/*``."""
        self.memory.keep_only({str(g) for g in pool})
        cut = 0
        for game, commands, turns in self.gather([(e.game, *self.shortest(e, env)) for e in episodes if e.won]):
            self.memory.record(game, commands)
            cut += turns
        draw = self.memory.draw(random.Random(f"self_imitation/{self.seed}/{iteration}"), self.cfg.episodes)
        replayed, failed = [], []
        for game, commands in draw[share]:
            episode = self.replay(game, commands, env)
            if episode is not None and episode.won:
                replayed.append(episode)
            else:  # a game fault, or a list that no longer wins
                failed.append(game)
        failed = self.gather(failed)
        for game in failed:
            self.memory.forget(game)
        return {**imitate(replayed), "imitation/episodes": float(len(draw) - len(failed)),
                "imitation/games": float(len(self.memory)), "imitation/loop_turns_cut": float(cut)}

    def state_dict(self) -> dict:
        return self.memory.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.memory.load_state_dict(state)

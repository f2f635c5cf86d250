"""Host work per turn of a rollout, counted as the rows grow: what a GPU batch needs linear.

    python bench/host_work.py     # the CPU layout at 16, 64 and 256 rows, the GPU layout at 4, 8 and 16; easy games

On a GPU the host builds every model call's token ids, positions and cache indices, and every turn's
prompts and command tries, while the device waits for them. A step that walks every row for each
row (a row lookup by ``list.index``, each row's cache start summed over the rows before it) is
invisible at 16 rows and sets the speed at 256. Counted, not timed: every Python bytecode
instruction executed in a frame of textrl's own modules (``sys.settrace`` with opcode events), plus
every element textrl's code scans with a list's or tuple's method (``index``, ``remove``...) or
hands to ``sum``, ``sorted``, ``min``, ``max``, ``any`` or ``all``, over one sampled rollout of
``rows`` episodes of the tiny model. Row i plays game i mod ``--games`` with that game's seed, so
every size plays the same games the same way with the same model calls (copies of a game tokenize
their prompts from the builder's memo, the same way at every size): work linear in the rows adds
the same count for every row added (``instructions_per_added_row`` equal from size to size), and a
step that walks every row for each row adds more the more rows there are.

Not counted: other work inside C (``x in a_list``, a slice, the tokenizer's Rust), the device's
(torch) work, and the model's own Python, which runs once per call, not per row. The counts depend
on the code, not on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

import textrl
from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.config import load_env_config, load_model_config
from textrl.games.pool import GamePool
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.model import build_policy
from textrl.rollout import Player, Sampling, play_games

PACKAGE = str(Path(textrl.__file__).parent) + os.sep


# methods of a list or tuple whose work grows with its length: each call counts that length
SCANS = {"index", "count", "remove", "insert", "sort", "copy"}
# builtins that consume what they are given: each call counts the elements it consumed
CONSUMERS = {"sum": sum, "sorted": sorted, "min": min, "max": max, "any": any, "all": all}


class HostWork:
    """Counts, while inside (this thread), the bytecode instructions executed in textrl's own frames,
    the length of each list or tuple they call a ``SCANS`` method of, and the elements they hand to
    a ``CONSUMERS`` builtin (each of textrl's modules sees a counting one in its globals meanwhile)."""

    def __init__(self):
        self.count = 0
        self._ours: dict[str, bool] = {}
        self._patched: list = []

    def ours(self, frame) -> bool:
        name = frame.f_code.co_filename
        ours = self._ours.get(name)
        if ours is None:
            ours = self._ours[name] = name.startswith(PACKAGE)
        return ours

    def _call(self, frame, event, arg):
        if not self.ours(frame):
            return None  # no local tracing: torch's, transformers' and TextWorld's frames cost one call each
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        return self._opcode

    def _opcode(self, frame, event, arg):
        if event == "opcode":
            self.count += 1
        return self._opcode

    def _builtin(self, frame, event, arg):
        if event == "c_call" and getattr(arg, "__name__", None) in SCANS and self.ours(frame):
            owner = getattr(arg, "__self__", None)
            if isinstance(owner, (list, tuple)):
                self.count += len(owner)

    def _tally(self, items):
        for item in items:
            self.count += 1
            yield item

    def _consuming(self, builtin):
        def call(*args, **kwargs):
            if len(args) == 1 or builtin is sum:  # an iterable (sum's second argument is its start)
                return builtin(self._tally(args[0]), *args[1:], **kwargs)
            self.count += len(args)  # min(a, b), max(a, b)
            return builtin(*args, **kwargs)
        return call

    def __enter__(self) -> "HostWork":
        for module in [m for name, m in sys.modules.items() if name == "textrl" or name.startswith("textrl.")]:
            for name, builtin in CONSUMERS.items():
                if name not in vars(module):  # a module's own name of that spelling is left alone
                    setattr(module, name, self._consuming(builtin))
                    self._patched.append((module, name))
        sys.settrace(self._call)
        sys.setprofile(self._builtin)
        return self

    def __exit__(self, *exc) -> None:
        sys.settrace(None)
        sys.setprofile(None)
        for module, name in self._patched:
            delattr(module, name)
        self._patched = []


def host_work(policy, tokenizer, games: list[Path], env, rows: int, batched: bool) -> dict:
    """One sampled rollout of ``rows`` episodes in one decoder (one batch), row i playing ``games[i %
    len(games)]`` with seed ``i % len(games)`` (copies play alike; episodes of different games end
    at different turns, so rows leave the batch as they do in training): textrl's instructions per
    episode turn, and the model calls it made."""
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy, batched=batched)])
    copies = [i % len(games) for i in range(rows)]
    with HostWork() as counted:
        episodes, stats = play_games(player, [games[i] for i in copies], env, Sampling(1.0, copies))
    turns = sum(e.length for e in episodes)
    return {"rows": rows, "layout": "batched" if batched else "per_row", "turns": turns,
            "episode_lengths": sorted({e.length for e in episodes}),
            "plays": sorted({tuple(s.action.command for s in e.steps) for e in episodes}),  # one per game
            "model_calls": stats.decode.calls, "instructions": counted.count,
            "instructions_per_turn": round(counted.count / turns, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    # the GPU layout runs eager FlexAttention on a CPU, whose scores span the whole buffer for every row
    ap.add_argument("--batched-rows", type=int, nargs="+", default=[4, 8, 16], help="rows of the GPU layout, run on a CPU")
    ap.add_argument("--games", type=int, default=4, help="distinct held-out easy games the rows play (divides every size)")
    ap.add_argument("--max-steps", type=int, default=5)
    ap.add_argument("--out", default="bench/results/host_work.json")
    args = ap.parse_args(argv)
    if any(n % args.games for n in args.rows + args.batched_rows):
        ap.error(f"--games {args.games} must divide every size: each game is played by as many rows at each size")
    env = dataclasses.replace(load_env_config("easy"), max_steps=args.max_steps)
    games = GamePool("easy").games("eval", args.games)  # the step limit is the env's own, not the games'
    torch.manual_seed(0)
    policy, tokenizer = build_policy(load_model_config("tiny"))
    sizes = {False: args.rows, True: args.batched_rows}
    runs = [host_work(policy, tokenizer, games, env, rows, batched) for batched in (False, True) for rows in sizes[batched]]
    layouts = {}
    for batched, layout in ((False, "per_row"), (True, "batched")):
        mine = [r for r in runs if r["layout"] == layout]
        # the same games' copies and the same model calls at every size: linear work adds the same per row
        added = [round((b["instructions"] - a["instructions"]) / (b["rows"] - a["rows"]), 2) for a, b in zip(mine, mine[1:])]
        layouts[layout] = {"rows": sizes[batched], "instructions_per_turn": [r["instructions_per_turn"] for r in mine],
                           "instructions_per_added_row": added}
        print(f"{layout}: at {sizes[batched]} rows, instructions per turn {layouts[layout]['instructions_per_turn']}, "
              f"per row added {added}")
    write_result(args.out, {"model": "tiny", "env": "easy", "max_steps": args.max_steps, "games": args.games,
                            "torch": torch.__version__, "layouts": layouts, "runs": runs}, argv)


if __name__ == "__main__":
    main()

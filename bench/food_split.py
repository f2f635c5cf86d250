"""Held-out tw-cooking wins by what the training games showed of each game's recipe.

With ``env.settings.split=train +env.eval_settings.split=valid`` the training and the held-out games
draw their ingredients from TextWorld's train and valid food splits. The valid split is not all new
foods: some of its ingredients are foods the training games also have, in a state (roasted, diced,
...) no training game has. This script sorts each held-out game by its recipe's ingredients,
against every ingredient of the training games (``game.json`` metadata, written by TextWorld):

* ``unseen food``: no training game has any of its foods;
* ``seen food, unseen preparation``: its foods occur in training, never in the states this recipe
  needs;
* ``seen food and preparation``: some ingredient occurs in training exactly as here.

and counts each group's wins for each evaluation given (``textrl-eval`` or a run's
``evaluation/iter_*.json``: ``per_game`` names each game by its directory in the pool).

    python bench/food_split.py --pool ~/.cache/textrl/games/<the run's tw-cooking pool> \\
        --eval trained=bench/results/families/tw_cooking/food_split/trained.json \\
               random=bench/results/families/tw_cooking/food_split/random/results.json \\
        --out bench/results/families/tw_cooking/food_split/by_food.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from result import write_result  # bench/result.py (the script directory is on sys.path)
from textrl.games.pool import EVAL_SEED_BASE  # held-out games' seeds start here; training games' below


def ingredients(game_dir: Path) -> list[tuple[str, ...]]:
    """The recipe's ingredients of one game, each (food, state, ...)."""
    meta = json.loads((game_dir / "game.json").read_text())["metadata"]
    return [tuple(x) for x in meta["ingredients"]]


def group_of(recipe: list[tuple[str, ...]], foods: set[str], prepared: set[tuple[str, ...]]) -> str:
    if all(i[0] not in foods for i in recipe):
        return "unseen food"
    if all(i not in prepared for i in recipe):
        return "seen food, unseen preparation"
    return "seen food and preparation"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", required=True, help="the run's game pool directory (one directory per game seed)")
    ap.add_argument("--eval", nargs="+", required=True, metavar="NAME=FILE", help="evaluations with per_game")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    pool = Path(args.pool).expanduser()
    seeds = sorted(int(p.name) for p in pool.iterdir() if p.is_dir() and p.name.isdigit())
    train = [s for s in seeds if s < EVAL_SEED_BASE]
    foods, prepared = set(), set()
    for s in train:
        for i in ingredients(pool / str(s)):
            foods.add(i[0])
            prepared.add(i)

    groups: dict[str, dict] = {}
    for spec in args.eval:
        name, path = spec.split("=", 1)
        per_game = json.loads(Path(path).read_text())["per_game"]
        for g in per_game:
            game = Path(g["game"]).name
            group = groups.setdefault(group_of(ingredients(pool / game), foods, prepared), {"games": set()})
            group["games"].add(game)
            group[f"{name}_wins"] = group.get(f"{name}_wins", 0) + int(g["won"])
    result = {"pool": pool.name, "training_games": len(train), "training_foods": sorted(foods),
              "groups": {k: {"games": len(v["games"]), **{n: c for n, c in v.items() if n != "games"}}
                         for k, v in sorted(groups.items())}}
    write_result(args.out, result, argv, show=result["groups"])
    return result


if __name__ == "__main__":
    main()

"""Where every benchmark writes its figures: bench/results/<name>.json, with the command behind them."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def command(argv) -> str:
    """The command line that reproduces this run (argv as given to main(), or the real one)."""
    return "python " + " ".join([sys.argv[0]] + list(argv if argv is not None else sys.argv[1:]))


def write_result(path: str, result: dict, argv, show: dict | None = None) -> None:
    """Write `result` plus its `command` to `path` as JSON, and print `show` (default: all of it)."""
    result = {**result, "command": command(argv)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(show if show is not None else result, indent=2))

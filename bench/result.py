"""Where every benchmark writes its figures: bench/results/<name>.json, with the command behind them."""

from __future__ import annotations

import json
import platform
import shlex
import sys
from pathlib import Path


def command(argv) -> str:
    """The command line that reproduces this run (argv as given to main(), or the real one)."""
    return "python " + shlex.join([sys.argv[0]] + list(argv if argv is not None else sys.argv[1:]))  # quoted as typed


def cpu_model() -> str:
    """The CPU's model name: speed figures compare only within one machine."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def write_result(path: str, result: dict, argv, show: dict | None = None) -> None:
    """Write `result` plus its `command` and the CPU model to `path` as JSON, and print `show`
    (default: all of it)."""
    result = {**result, "cpu": result.get("cpu") or cpu_model(), "command": command(argv)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(show if show is not None else result, indent=2))

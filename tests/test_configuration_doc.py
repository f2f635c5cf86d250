"""docs/configuration.md documents every config key, one table row each, and no key that is gone.

The keys are read from the dataclasses themselves (``dataclasses.fields`` from ``TrainConfig``
down through its nested groups); the document's keys are the backticked names in the first column
of its key tables (`env.num_envs`, `seed`). A key added to a dataclass without its line, or a line left
for a removed key, fails here; so does a default column that no longer says the dataclass default.
"""

from __future__ import annotations

import dataclasses
import re

from omegaconf import MISSING

from textrl.config import CONF_DIR, TrainConfig

DOC = CONF_DIR.parent / "docs" / "configuration.md"
KEY = re.compile(r"^`([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)`$")


def dataclass_keys(cls=TrainConfig, prefix: str = "") -> dict[str, object]:
    """Every leaf key under ``cls`` (dotted), with its default."""
    keys = {}
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
            keys.update(dataclass_keys(f.default_factory, f"{prefix}{f.name}."))
        else:
            keys[prefix + f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return keys


def documented_rows() -> dict[str, str]:
    """key -> its default cell, for every row of a key table (header `| key | default | ...`) whose
    first cell is one backticked key."""
    rows, in_key_table = {}, False
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            in_key_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["key", "default"]:
            in_key_table = True
        elif in_key_table and (m := KEY.match(cells[0])):
            assert m.group(1) not in rows, f"{m.group(1)} is documented twice"
            rows[m.group(1)] = cells[1] if len(cells) > 1 else ""
    return rows


def _value(cell: str):
    text = cell.strip("`")
    if text in {"null", "true", "false", "[]", "{}"}:
        return {"null": None, "true": True, "false": False, "[]": [], "{}": {}}[text]
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def test_every_key_of_the_dataclasses_is_documented():
    missing = sorted(set(dataclass_keys()) - set(documented_rows()))
    assert not missing, f"docs/configuration.md has no line for {missing}"


def test_every_documented_key_exists():
    gone = sorted(set(documented_rows()) - set(dataclass_keys()))
    assert not gone, f"docs/configuration.md documents keys the dataclasses do not have: {gone}"


def test_each_documented_default_is_the_dataclass_default():
    keys = dataclass_keys()
    for key, cell in documented_rows().items():
        if key in keys and keys[key] is not MISSING:
            assert _value(cell) == keys[key], f"{key}: docs/configuration.md says {cell}, the dataclass {keys[key]!r}"

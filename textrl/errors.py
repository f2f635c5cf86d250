"""User-facing errors that several layers raise, here so that none of them imports a layer above it
for an exception class. ``textrl.cli.train`` prints these as one line instead of a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value outside what is allowed; the message names the key, the value and the rule."""


class GameFileError(ValueError):
    """A game file that is missing or that its game engine cannot load."""

"""User-facing errors that several layers raise, here so that none of them imports a layer above it
for an exception class. ``textrl.cli.train`` prints these as one line instead of a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value outside what is allowed; the message names the key, the value and the rule."""


class GameFileError(ValueError):
    """A game file that is missing or that its game engine cannot load."""


class NonFiniteError(RuntimeError):
    """Training produced non-finite values it cannot step past: too many optimizer steps in a row
    with a non-finite loss or gradient, or a non-finite weight. Raised before any checkpoint of the
    iteration is written, so ``last.ckpt`` keeps the last finite policy."""


class GameFaultError(RuntimeError):
    """More than ``env.max_aborted`` of an iteration's episodes were aborted by game faults (an
    engine error, no answer within ``env.step_timeout``, a dead step worker or Java engine)."""

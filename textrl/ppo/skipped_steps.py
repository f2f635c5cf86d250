"""The rule for an optimizer step whose loss or gradient is not finite, shared by the PPO update and
the warm start: such a step never reaches the weights, and too many in a row stop the run.

Under fp16 loss scaling (``16-mixed``) the scaler skips a step whose scaled gradient overflowed and
lowers its scale: that is its job, and the step is handed to it. A non-finite *loss* is not an
overflow the scale can cure (an fp16 overflow in the forward, a NaN advantage): the scaler would
skip it forever while its scale collapses, so it counts toward the limit whether or not a scaler runs.
"""

from __future__ import annotations

import logging
import math

from textrl.errors import NonFiniteError

log = logging.getLogger(__name__)


class SkippedSteps:
    def __init__(self, limit: int, what: str, remedy: str):
        self.limit = limit  # ppo.max_skipped_steps
        self.what, self.remedy = what, remedy  # the error's opening and closing words
        self.in_a_row = 0  # steps not taken for a non-finite loss or gradient, across iterations

    def decide(self, loss: float, grad_norms: list[float], scaled: bool) -> tuple[bool, bool]:
        """(call ``optimizer.step()``, the step counts as taken) for a step of ``loss`` (summed over
        its minibatches, and over the ranks) and ``grad_norms`` (after DDP's all-reduce: the same on
        every rank, so all decide alike). Raises ``NonFiniteError`` at the limit."""
        grads_finite = all(math.isfinite(n) for n in grad_norms)
        if math.isfinite(loss) and grads_finite:
            self.in_a_row = 0
            return True, True
        if math.isfinite(loss) and scaled:  # a scaled gradient overflowed: the scaler skips the step
            return True, False
        self.in_a_row += 1
        log.warning("%s: optimizer step skipped: non-finite %s (loss %s, gradient norms %s)", self.what,
                    "loss" if not math.isfinite(loss) else "gradient", loss, grad_norms)
        if self.in_a_row >= self.limit:
            raise NonFiniteError(f"{self.what}: {self.in_a_row} optimizer steps in a row had a non-finite loss or "
                                 f"gradient (ppo.max_skipped_steps={self.limit}); {self.remedy}")
        return False, False

"""Token-level GAE over the decision tokens of an episode.

How a turn's reward reaches its tokens: the decisions of an episode form one sequence
d_1 .. d_K (forks of the command tries, in the order they were sampled). A turn's reward is
credited to the *last* decision of that turn; its other decisions get 0 and learn through
bootstrapping (gamma and lambda apply per decision token, as in the seed). A turn with no
decision (a single admissible command) adds its reward to the latest earlier decision; if the
episode has none yet, there is no action to credit and the reward is dropped. The episode's last
decision is terminal: step-limit truncation is treated as the end of the game too (the state
carries no time left, so there is nothing sound to bootstrap from).
"""

from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over a flat sequence of decisions.

    ``dones[k]`` is 1 where decision k ends its episode (no bootstrap past it). Several episodes
    may be concatenated. Returns (advantages, returns = advantages + values).
    """
    advantages = torch.zeros_like(values)
    next_value = torch.zeros((), dtype=values.dtype)
    running = torch.zeros((), dtype=values.dtype)
    for k in range(len(rewards) - 1, -1, -1):
        live = 1.0 - dones[k].to(values.dtype)
        delta = rewards[k] + gamma * next_value * live - values[k]
        running = delta + gamma * lam * live * running
        advantages[k] = running
        next_value = values[k]
    return advantages, advantages + values


def whiten(x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Zero mean, unit variance (advantage normalisation)."""
    if x.numel() < 2:
        return x - x.mean()
    return (x - x.mean()) / (x.std() + eps)

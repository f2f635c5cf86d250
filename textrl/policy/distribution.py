"""The policy's distribution at a fork of the command trie: over the fork's children only.

A fork's children are a few token ids. Every function here works on rows [forks, width] of their
logits, padded to the widest fork (``Forks``), with ``valid`` marking the real entries; a bool
mask over the whole vocabulary is the same computation, only wider. The decoder draws from
``fork_logprobs`` and the PPO loss recomputes it from the same entries, so the two cannot drift
apart: that is what keeps the first minibatch's ratio at exactly 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch



def fork_parts(allowed: list[list[int]]) -> dict[str, list[int]]:
    """The host ints of forks with these allowed token ids, for ``ints_to_device``: each fork's
    children padded to the widest by repeating its first, back to back, and each fork's size."""
    width = max(len(a) for a in allowed)
    return {"fork_index": [t for a in allowed for t in a + a[:1] * (width - len(a))],
            "fork_sizes": [len(a) for a in allowed]}


@dataclass
class Forks:
    """Forks on the device: one row per fork, its children padded to the widest (``index``), which
    entries are real (``valid``), and each fork's size on the host."""

    index: torch.Tensor  # [forks, width] long
    valid: torch.Tensor  # [forks, width] bool
    sizes: list[int]

    @classmethod
    def on_device(cls, allowed: list[list[int]], ints: dict[str, torch.Tensor]) -> "Forks":
        """From ``fork_parts(allowed)`` already on the device (copied with a call's other ints)."""
        sizes = [len(a) for a in allowed]
        index = ints["fork_index"].view(len(allowed), max(sizes))
        valid = torch.arange(index.shape[1], device=index.device)[None] < ints["fork_sizes"][:, None]
        return cls(index, valid, sizes)


def fork_logprobs(logits: torch.Tensor, valid: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                  explore: float = 0.0) -> torch.Tensor:
    """log-probs of softmax(logits / T) over the valid entries (-inf elsewhere), mixed with
    ``explore`` x uniform (``mix_uniform``). ``temperature``: a number, or one per row ([rows, 1])."""
    scaled = logits.float() / temperature
    return mix_uniform(torch.log_softmax(scaled.masked_fill(~valid, float("-inf")), dim=-1), valid, explore)


def mix_uniform(logp: torch.Tensor, valid: torch.Tensor, explore: float) -> torch.Tensor:
    """log((1 - e) p + e / n) over each row's n valid entries (-inf elsewhere): every admissible
    child keeps at least e / n of the probability however sure the model's prior is, which is what
    lets a policy that puts p = 0.95 on the wrong verb still try the right one. Differentiable in p."""
    if explore == 0.0:
        return logp
    n = valid.sum(-1, keepdim=True).to(logp.dtype)
    mixed = torch.logaddexp(logp + math.log1p(-explore), torch.log(explore / n))
    return mixed.masked_fill(~valid, float("-inf"))


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of each row's distribution (-inf entries have probability 0 and contribute 0)."""
    probs = logp.exp()
    return -(probs * logp.masked_fill(probs == 0, 0.0)).sum(-1)


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Exact KL(p || ref) of each row over its fork's children (a few entries: no estimator needed).

    ``logp``: the policy's log-probs (-inf at the padding); ``ref_logp``: the reference policy's
    log-probs of the same entries, -inf at the padding.
    """
    valid = torch.isfinite(ref_logp)
    # zeros at the padding before any arithmetic: exp(-inf) x -inf there would be a NaN gradient
    logp = logp.masked_fill(~valid, 0.0)
    terms = logp.exp() * (logp - ref_logp.masked_fill(~valid, 0.0))
    return terms.masked_fill(~valid, 0.0).sum(-1)

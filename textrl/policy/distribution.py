"""The policy's distribution at a fork of the command trie: over the fork's children only.

A fork's children are a few token ids. Every function here works on rows [forks, width] of their
logits, padded to the widest fork (``fork_index``), with ``valid`` marking the real entries; a bool
mask over the whole vocabulary is the same computation, only wider. The decoder draws from
``fork_logprobs`` and the PPO loss recomputes it from the same entries, so the two cannot drift
apart: that is what keeps the first minibatch's ratio at exactly 1.
"""

from __future__ import annotations

import math

import torch


def fork_index(allowed: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, valid) of forks with these allowed token ids: one row per fork, padded to the widest
    by repeating its first id, and which entries are real."""
    width = max(len(a) for a in allowed)
    index = torch.tensor([a + a[:1] * (width - len(a)) for a in allowed], device=device)
    valid = torch.tensor([[k < len(a) for k in range(width)] for a in allowed], device=device)
    return index, valid


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

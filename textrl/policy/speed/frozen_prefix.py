"""The frozen blocks under the trainable ones, run once per token per PPO iteration: in the rollout.

With ``model.trainable_layers=6`` (SmolLM2: 24 of its 30 blocks frozen) every pass over a rollout --
the recompute of the old log-probs, the KL reference, each PPO epoch -- used to run the 24 frozen
blocks again on the same tokens, for the same result. Now the rollout's decoder records the output of
the last frozen block at every token it feeds (``ConstrainedDecoder.capture``), each training
sequence takes over its tokens' recordings (``training_sequences``), and every forward of the update
makes the frozen blocks return the recording instead of computing it: only the trainable blocks (and
the embedding lookup, which is free) run. A sequence without a recording records it in its first
forward of the iteration; the warm start's cloning records each walkthrough sequence's in its first
pass and replays it in the later ones. The
recording is the frozen blocks' function of the same tokens and positions, computed with the KV
cache: equal to a full forward's up to rounding, and the update's passes all replay the same tensor,
so the first minibatch's ratio is still exactly 1 (``ppo.recompute_old``) -- bitwise when the passes
have the same shapes (the recompute runs the first pass's own minibatches).

Valid only while nothing at or below the last frozen block trains: ``FrozenPrefix.of`` checks that
every trainable parameter is registered after the first trainable block starts (Hugging Face models
register embeddings, blocks, final norm and head in data-flow order), and returns None otherwise
(LoRA on every block, full fine-tuning, a trainable embedding), where every forward runs in full.
``ppo.cache_frozen=false`` switches it off (the recordings cost hidden-size floats per token of the
rollout, kept for the iteration).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def transformer_blocks(lm: nn.Module) -> nn.ModuleList:
    """The model's stack of transformer blocks: its longest ModuleList (any Hugging Face causal LM)."""
    return max((m for m in lm.modules() if isinstance(m, nn.ModuleList)), key=len)


class FrozenPrefix:
    def __init__(self, blocks: nn.ModuleList, n_frozen: int):
        self.blocks = blocks
        self.n_frozen = n_frozen

    @classmethod
    def of(cls, lm: nn.Module) -> "FrozenPrefix | None":
        """The frozen blocks under the trainable ones of ``lm``, or None when there are none to skip."""
        blocks = transformer_blocks(lm)
        n = next((i for i, b in enumerate(blocks) if any(p.requires_grad for p in b.parameters())), len(blocks))
        if n in (0, len(blocks)):
            return None
        first_trainable = {id(p) for p in blocks[n].parameters()}
        for p in lm.parameters():  # registration order: everything before block n feeds it
            if id(p) in first_trainable:
                break
            if p.requires_grad:
                return None
        return cls(blocks, n)

    @contextmanager
    def record(self):
        """Inside, a forward appends the last frozen block's output to the yielded list
        (``recorded_output`` reads it)."""
        recorded: list = []
        handle = self.blocks[self.n_frozen - 1].register_forward_hook(lambda module, args, out: recorded.append(out))
        try:
            yield recorded
        finally:
            handle.remove()

    def recorded_output(self, recorded: list) -> torch.Tensor:
        """The one tensor a forward inside ``record`` recorded."""
        if len(recorded) != 1 or not isinstance(recorded[0], torch.Tensor):
            raise RuntimeError(f"{type(self.blocks[0]).__name__} blocks do not return one tensor, so their "
                               f"output cannot be recorded and replayed; run with ppo.cache_frozen=false")
        return recorded[0]

    @contextmanager
    def replay(self, output: torch.Tensor):
        """Inside, the frozen blocks return ``output`` (the last frozen block's recorded output)
        without computing anything; their forward hooks still run."""
        frozen = list(self.blocks[: self.n_frozen])
        # an instance attribute shadows the class's forward; keep one that was there (accelerate's
        # device hooks wrap forward this way) to put it back
        saved = [block.__dict__.get("forward") for block in frozen]
        for block in frozen:
            block.forward = lambda *args, **kwargs: output
        try:
            yield
        finally:
            for block, previous in zip(frozen, saved):
                del block.forward
                if previous is not None:
                    block.forward = previous

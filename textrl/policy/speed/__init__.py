"""The speed machinery under the policy: what makes a CPU (or GPU) rollout and update fast, and
nothing a newcomer needs to read to follow one PPO iteration.

- ``precision``: which autocast a run plays and trains under (``memory=auto`` measured on a CPU).
- ``ragged_cache``: the packed KV cache of a batched rollout, each row attending to its own positions.
- ``cpu_attention``: attention as matrix products where a CPU computes them faster than SDPA.
- ``stream``: turns cut from the prompt's history dropped from the KV cache, not fed again.
- ``frozen_prefix``: the frozen blocks' output recorded in the rollout and replayed by the update.
- ``cast_once``: linear layers on weights cast to the autocast dtype once, not at every call.

The decoder, the model and the update use only the names below.
"""

from textrl.policy.speed.cast_once import weights_cast_once
from textrl.policy.speed.cpu_attention import attend, products_run
from textrl.policy.speed.frozen_prefix import FrozenPrefix, transformer_blocks
from textrl.policy.speed.precision import (AUTO_PRECISION_ENV, PRECISIONS, autocast_context, choose_precision,
                                           resolve_precision)
from textrl.policy.speed.ragged_cache import UNSUPPORTED, RaggedCache, routed_to_ragged
from textrl.policy.speed.stream import Drop, StreamLayout, find_cut, runs, stream_attention

__all__ = ["AUTO_PRECISION_ENV", "PRECISIONS", "Drop", "FrozenPrefix", "RaggedCache", "StreamLayout", "UNSUPPORTED",
           "attend", "autocast_context", "choose_precision", "find_cut", "products_run", "resolve_precision",
           "routed_to_ragged", "runs", "stream_attention", "transformer_blocks", "weights_cast_once"]

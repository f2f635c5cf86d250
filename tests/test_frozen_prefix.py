"""The frozen blocks under the trainable ones run once per sequence per iteration, and skipping them
changes nothing the update computes (textrl/policy/speed/frozen_prefix.py)."""

import pytest
import torch

from textrl.config import load_model_config
from textrl.games.env import TextGame
from textrl.games.prompt import PromptBuilder
from textrl.policy.decoding import ConstrainedDecoder
from textrl.policy.speed.frozen_prefix import FrozenPrefix
from textrl.policy.model import build_policy, transformer_blocks
from textrl.ppo.sequences import PrefixOutputs, decision_forward, training_sequences
from textrl.rollout import Sampling, decode_episodes

ARCHITECTURES = {  # two blocks each, the lower one frozen: every family's own code path
    "llama": ("tiny", {}),
    "gpt2": ("gpt2", {"source": "random", "architecture": {"n_layer": 2}}),
    "qwen2": ("qwen", {"source": "random", "architecture": {"num_hidden_layers": 2}}),
}


def sequences_of(policy, tokenizer, games, max_steps=3):
    envs = [TextGame(p, max_steps) for p in games]
    episodes, _ = decode_episodes(envs, [ConstrainedDecoder(policy)], PromptBuilder(tokenizer),
                                  Sampling(1.0, list(range(len(games)))), bootstrap=True)
    return training_sequences(episodes).sequences


def outputs_and_grads(policy, batch, pad_id, prefix=None):
    params = [p for p in policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    d = decision_forward(policy, batch, pad_id, prefix)
    (d.logits.masked_fill(~d.valid, 0).sum() + d.values.sum()).backward()
    return d.logits.detach(), d.values.detach(), [p.grad.clone() for p in params if p.grad is not None]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_replaying_the_frozen_blocks_computes_the_full_forward(arch, easy_games):
    name, overrides = ARCHITECTURES[arch]
    torch.manual_seed(0)
    policy, tokenizer = build_policy(load_model_config(name, trainable_layers=1, **overrides))
    frozen = FrozenPrefix.of(policy.lm)
    assert frozen is not None and frozen.n_frozen == 1
    # the frozen part: everything registered before the top block (GPT-2's position embeddings too)
    params = list(policy.lm.parameters())
    first_top = next(transformer_blocks(policy.lm)[1].parameters())
    start = next(i for i, p in enumerate(params) if p is first_top)
    assert start > 0 and not any(p.requires_grad for p in params[:start])
    assert any(p.requires_grad for p in params[start:])
    sequences = sequences_of(policy, tokenizer, easy_games[:3])
    assert len(sequences) >= 2
    pad = tokenizer.pad_token_id
    runs = []  # forwards that executed the frozen block's own layers
    lower = transformer_blocks(policy.lm)[0]
    leaf = next(m for m in lower.modules() if m is not lower and not list(m.children()))
    leaf.register_forward_pre_hook(lambda *_: runs.append(1))

    prefix = PrefixOutputs(frozen, [None] * len(sequences))  # nothing recorded by the rollout
    one = sequences[:1]
    full = outputs_and_grads(policy, one, pad)
    recorded = outputs_and_grads(policy, one, pad, prefix)  # first forward: runs in full, records
    kept = prefix.outputs[one[0].index]
    assert kept is not None and kept.shape[0] == len(one[0].input_ids)
    runs.clear()
    replayed = outputs_and_grads(policy, one, pad, prefix)  # later forward: frozen block skipped
    assert runs == []
    for a, b, c in zip(full[:2], recorded[:2], replayed[:2]):  # same shapes: bitwise
        assert torch.equal(a, b) and torch.equal(a, c)
    assert len(full[2]) == len(replayed[2]) > 0 and all(torch.equal(a, b) for a, b in zip(full[2], replayed[2]))

    # recorded one by one, replayed together (zero padding at the shorter one's end)
    pair = sequences[:2]
    full = outputs_and_grads(policy, pair, pad)
    for s in pair:
        outputs_and_grads(policy, [s], pad, prefix)
    runs.clear()
    replayed = outputs_and_grads(policy, pair, pad, prefix)
    assert runs == []
    assert torch.allclose(full[0], replayed[0], atol=1e-5) and torch.allclose(full[1], replayed[1], atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(full[2], replayed[2]))
    # the frozen blocks compute again once the replay is over
    outputs_and_grads(policy, pair, pad)
    assert runs != []


def test_nothing_is_skipped_when_the_lower_part_trains():
    policy, _ = build_policy(load_model_config("tiny"))  # every block trains
    assert FrozenPrefix.of(policy.lm) is None
    policy, _ = build_policy(load_model_config("tiny", trainable_layers=1))
    assert FrozenPrefix.of(policy.lm) is not None
    policy.lm.get_input_embeddings().weight.requires_grad_(True)  # the embedding feeds the frozen block
    assert FrozenPrefix.of(policy.lm) is None


def test_a_training_iteration_with_frozen_blocks_keeps_the_first_ratio_at_one(tmp_path):
    """The PPO update with the top block trainable: the frozen block runs only in the rollout (the
    recompute, the KL reference and the epochs replay the rollout's recording), the first
    minibatch's ratios are exactly 1 in fp32, and switching the cache off gives the same losses."""
    import lightning as L

    from tests.conftest import config, read_metrics
    import textrl.cli.train as cli

    class CountFrozenRuns(L.Callback):
        """Forwards through the frozen block's own layers in train mode (rollouts run in eval mode)."""

        def __init__(self):
            self.runs = 0

        def on_fit_start(self, trainer, module):
            lower = transformer_blocks(module.policy.lm)[0]
            leaf = next(m for m in lower.modules() if m is not lower and not list(m.children()))
            leaf.register_forward_pre_hook(lambda m, *_: setattr(self, "runs", self.runs + module.policy.training))

    rows, runs = {}, {}
    for cache in (True, False):
        run = tmp_path / str(cache)
        cfg = config(run, "iterations=1", "eval.every=1", "eval.before_training=false", "model.trainable_layers=1",
                     "ppo.recompute_old=true", "ppo.kl_coef=0.1", f"ppo.cache_frozen={cache}",
                     "env.history_len=3", "env.drop_turns_from_cache=true")  # the replay covers streams too
        counter = CountFrozenRuns()
        result = cli.train(cfg, callbacks=[counter])
        assert (result["module"].update.frozen is not None) == cache
        rows[cache], runs[cache] = next(r for r in read_metrics(run) if r.get("loss/policy")), counter.runs
    assert runs[True] == 0 and runs[False] > 0
    assert float(rows[True]["policy/first_logratio_max"]) == 0.0
    for key in ("loss/policy", "loss/value", "loss/entropy", "policy/approx_kl", "optim/grad_norm"):
        assert float(rows[True][key]) == pytest.approx(float(rows[False][key]), rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("budget", [1024, 400])  # 400: histories truncate, rows restart in the decoder
def test_the_rollout_records_the_frozen_output_the_update_replays(budget, easy_games):
    """The decoder keeps the last frozen block's output at every token it feeds; each training
    sequence takes over its tokens' outputs, which equal a full forward's, so the update's first
    forward already skips the frozen block."""
    torch.manual_seed(0)
    policy, tokenizer = build_policy(load_model_config("tiny", trainable_layers=1))
    frozen = FrozenPrefix.of(policy.lm)
    decoder = ConstrainedDecoder(policy, capture=frozen)
    prompts = PromptBuilder(tokenizer, max_prompt_tokens=budget)
    episodes, _ = decode_episodes([TextGame(p, 6) for p in easy_games[:4]], [decoder], prompts,
                                  Sampling(1.0, list(range(4))), bootstrap=True)
    rollout = training_sequences(episodes)
    sequences, captured = rollout.sequences, rollout.prefix_outputs
    # read, not taken: the episodes keep theirs until the update releases them (release_prefix_outputs)
    assert all(step.action.prefix_output is not None for e in episodes for step in e.steps if step.action.decisions)
    assert len(sequences) >= 4 and all(c is not None for c in captured)
    if budget == 400:  # a sequence per restart, each with its own recording
        assert len(sequences) > len(episodes)
    for s, c in zip(sequences, captured):  # it ends at its last decision's position and covers exactly its tokens
        assert len(s.input_ids) == max(s.positions) + 1 == c.shape[0]
    pad = tokenizer.pad_token_id
    fresh = PrefixOutputs(frozen, [None] * len(sequences))
    for s in sequences:
        decision_forward(policy, [s], pad, fresh)  # records it from a full forward
    for mine, full in zip(captured, fresh.outputs):
        assert torch.allclose(mine, full, atol=1e-5)
    runs = []  # forwards that executed the frozen block's own layers
    lower = transformer_blocks(policy.lm)[0]
    leaf = next(m for m in lower.modules() if m is not lower and not list(m.children()))
    leaf.register_forward_pre_hook(lambda *_: runs.append(1))
    decision_forward(policy, sequences[:2], pad, PrefixOutputs(frozen, captured))
    assert runs == []

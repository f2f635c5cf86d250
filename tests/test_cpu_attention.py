"""bf16 attention on a CPU (``textrl.policy.speed.cpu_attention``): the matrix products compute what SDPA
computes (exactly in fp32, within bf16's rounding of the scores in bf16), run only where the
measured decision says they are faster, and the decision is measured once and read back."""

import json

import pytest
import torch
from torch.nn import functional as F

from tests.test_stream import play
from textrl.policy.speed import cpu_attention
from textrl.policy.speed.cpu_attention import attend, matmul_attention, matmul_is_faster
from textrl.policy.distribution import fork_logprobs
from textrl.ppo.sequences import decision_forward, training_sequences

FUSED = "aten::_scaled_dot_product_flash_attention_for_cpu"


def block(m, n, heads=6, kv_heads=2, dim=16, dtype=torch.float32, seed=0):
    """A prompt block: ``m`` queries over ``n`` keys, bottom-right causal (None for one query)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, m, dim, generator=gen) * 2
    k = torch.randn(1, kv_heads, n, dim, generator=gen) * 2
    v = torch.randn(1, kv_heads, n, dim, generator=gen)
    mask = None if m == 1 else torch.ones(m, n, dtype=torch.bool).tril(n - m)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], mask


@pytest.fixture
def decided(monkeypatch):
    """Sets this machine's decision (True: the products are faster) for the test."""
    return lambda faster: monkeypatch.setattr(cpu_attention, "matmul_is_faster", lambda: faster)


@pytest.mark.parametrize("m,n,chunk", [(1, 40, 128), (7, 40, 128), (40, 40, 128), (45, 90, 8), (300, 300, 128)])
def test_in_fp32_the_products_compute_what_sdpa_computes_gradients_included(m, n, chunk):
    """Bottom-right causal, as SDPA's mask says; chunks smaller than the block (``chunk`` 8 of 45
    queries; 300 causal queries in chunks of 128) see exactly the keys the mask lets them see."""
    (q, k, v), mask = block(m, n)
    ours = matmul_attention(q, k, v, None, chunk=chunk)
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(ours, theirs, atol=1e-5)
    g = torch.randn_like(ours)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), g), torch.autograd.grad(theirs, (q, k, v), g)):
        assert torch.allclose(a, b, atol=1e-4)


def test_in_bf16_the_products_are_within_the_rounding_of_bf16_scores():
    """The scores are rounded to bf16 before the softmax, so the output is farther from fp32's than
    the fused kernel's (which keeps them in fp32), by about a bf16 step of the scores."""
    (q, k, v), mask = block(170, 700, dtype=torch.bfloat16)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    ours = (matmul_attention(q, k, v, None).float() - reference).abs()
    fused = (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).float() - reference).abs()
    assert ours.max() < 0.15 and ours.mean() < 0.01
    assert fused.max() < ours.max()
    # the bound is not loose enough to pass a wrong mask (top-left causal: the first keys only)
    wrong = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=torch.ones_like(mask).tril(),
                                           enable_gqa=True)
    assert (wrong - reference).abs().max() > 0.5


@pytest.mark.parametrize("faster", [True, False])
def test_attend_runs_the_products_only_in_bf16_on_a_cpu_and_only_where_measured_faster(decided, faster):
    decided(faster)
    for dtype in (torch.bfloat16, torch.float32):
        (q, k, v), mask = block(20, 60, dtype=dtype)
        with torch.no_grad(), torch.profiler.profile() as prof:
            attend(q, k, v, None, mask)
        fused = any(e.name == FUSED for e in prof.events())
        assert fused == (dtype == torch.float32 or not faster), (dtype, faster)
    # fp32 tensors under bf16 autocast (the update's queries and keys) compute in bf16: the products
    (q, k, v), mask = block(20, 60)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16), torch.profiler.profile() as prof:
        out = attend(q, k, v, None, mask)
    assert out.dtype == torch.bfloat16
    assert any(e.name == FUSED for e in prof.events()) == (not faster)


def test_the_decision_is_measured_once_then_read_from_the_cache(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TEXTRL_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(cpu_attention, "_measure", lambda: measured.append(1) or (0.004, 0.002))
    matmul_is_faster.cache_clear()
    try:
        with caplog.at_level("INFO", logger="textrl.policy.speed.cpu_attention"):
            assert matmul_is_faster() is True
        # one line: the choice and both figures
        assert "matrix products (measured: the fused SDPA kernel 4.00 ms, matrix products 2.00 ms" in caplog.text
        (path,) = (tmp_path / "precision").glob("attention-*.json")
        assert json.loads(path.read_text())["matmul_is_faster"] is True
        matmul_is_faster.cache_clear()  # a new process: read back, not measured, and said so
        monkeypatch.setattr(cpu_attention, "_measure", lambda: pytest.fail("measured again"))
        caplog.clear()
        with caplog.at_level("INFO", logger="textrl.policy.speed.cpu_attention"):
            assert matmul_is_faster() is True
        assert "matrix products (measured before: the fused SDPA kernel 4.00 ms, matrix products 2.00 ms" in caplog.text
        # an unreadable file is measured again, and replaced
        path.write_text("{")
        matmul_is_faster.cache_clear()
        monkeypatch.setattr(cpu_attention, "_measure", lambda: measured.append(1) or (0.002, 0.004))
        assert matmul_is_faster() is False
        assert len(measured) == 2 and json.loads(path.read_text())["matmul_is_faster"] is False
    finally:
        matmul_is_faster.cache_clear()


def test_a_bf16_rollout_and_its_update_attend_through_the_products_with_log_probs_near_the_rollouts(
        tiny, easy_games, decided, monkeypatch):
    """A bf16 rollout with cut turns dropped from the cache (the rows' calls) and the update's forward
    over its streams (the stream blocks) both run the products, and the update's log-probs are the
    rollout's within bf16's rounding (the recompute pass takes the update's as the old ones)."""
    decided(True)
    policy, tokenizer = tiny
    calls = []
    real = cpu_attention.matmul_attention
    monkeypatch.setattr(cpu_attention, "matmul_attention", lambda *a, **kw: calls.append(a[0].shape[2]) or real(*a, **kw))
    with torch.autocast("cpu", torch.bfloat16):
        episodes, _ = play(policy, tokenizer, easy_games[:4])
        rolled = len(calls)
        rollout = training_sequences(episodes)
        assert any(s.drops for s in rollout.sequences)
        worst = 0.0
        for s in rollout.sequences:
            with torch.no_grad():
                out = decision_forward(policy, [s], tokenizer.pad_token_id)
            logp = fork_logprobs(out.logits, out.valid, 1.0).gather(1, out.chosen[:, None])[:, 0]
            worst = max(worst, (logp - rollout.logprobs[out.decisions]).abs().max().item())
    assert rolled > 0 and len(calls) > rolled  # both the rollout and the update ran them
    assert max(calls) > 1  # prompt blocks, not only single-query steps
    assert worst < 0.1


def test_the_updates_forward_of_an_uncut_sequence_runs_the_products_in_bf16(tiny, prompts, easy_games, decided,
                                                                             monkeypatch):
    """Without cuts the update forwards each sequence causally (transformers' path through
    ``sdpa_attention``): in bf16 it runs the products too, with the fused kernel's result within
    bf16's rounding; in fp32 it is transformers' code, unchanged."""
    from textrl.games.env import TextGame

    policy, _ = tiny
    env = TextGame(easy_games[0], 8)
    env.reset()
    ids = torch.tensor([prompts.build(env.observation, env.history)])
    positions = torch.arange(ids.shape[1])[None]
    calls = []
    real = cpu_attention.matmul_attention
    monkeypatch.setattr(cpu_attention, "matmul_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    hidden = {}
    for faster in (True, False):
        decided(faster)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            hidden[faster] = policy.hidden(ids, None, positions)[0].float()
        assert bool(calls) == faster
        calls.clear()
    assert (hidden[True] - hidden[False]).abs().max() < 0.1 * hidden[False].abs().max()
    with torch.no_grad():
        policy.hidden(ids, None, positions)
    assert not calls


def test_a_cache_it_cannot_write_costs_a_warning_and_the_decision_stands(monkeypatch, tmp_path, caplog):
    blocked = tmp_path / "a file, not a directory"
    blocked.write_text("")
    monkeypatch.setenv("TEXTRL_CACHE", str(blocked))
    monkeypatch.setattr(cpu_attention, "_measure", lambda: (0.002, 0.004))
    matmul_is_faster.cache_clear()
    try:
        assert matmul_is_faster() is False
    finally:
        matmul_is_faster.cache_clear()
    assert "could not cache the attention decision" in caplog.text

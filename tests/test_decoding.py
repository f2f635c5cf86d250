"""Constrained decoding on real games with the real tiny model."""

import math
import random

import pytest
import torch

from textrl.games.env import TextGame
from textrl.policy.decoding import ConstrainedDecoder, PromptCache, score_commands
from textrl.policy.distribution import fork_logprobs
from textrl.policy.trie import CommandTrie
from textrl.rollout import Sampling, decode_episodes


def trie_for(obs, prompts):
    return CommandTrie(obs.admissible_commands, prompts.encode_command, prompts.end_id)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
def test_only_admissible_commands_are_ever_emitted(tiny, prompts, easy_games, temperature):
    """64 samples per state, two states per game, 24 games: 3072 samples per temperature."""
    policy, tokenizer = tiny
    decoder = ConstrainedDecoder(policy)
    rngs = [torch.Generator().manual_seed(1000 + i) for i in range(64)]
    rng = random.Random(0)
    emitted = set()
    for path in easy_games:
        env = TextGame(path, 8)
        env.reset()
        for _ in range(2):
            obs = env.observation
            trie = trie_for(obs, prompts)
            prompt = prompts.build(obs, env.history)
            decoder.reset()
            actions = decoder.act(list(range(64)), [prompt] * 64, [trie] * 64, temperature, rngs=rngs)
            for action in actions:
                assert action.command in obs.admissible_commands
                assert action.command_ids == trie.commands[action.command]
                assert [d.index for d in action.decisions] == trie.decisions(action.command)
                for d in action.decisions:
                    assert d.token in d.allowed and action.command_ids[d.index] == d.token
                emitted.add(action.command)
            if env.step(rng.choice(obs.admissible_commands)).done:
                env.reset()
    assert len(emitted) > 20  # sampling really explores, not one command over and over


def test_token_packs_are_consecutive_sequences_within_the_budget():
    from textrl.ppo.sequences import token_packs

    assert token_packs([100, 100, 100], 250) == [(0, 2), (2, 3)]
    assert token_packs([300, 100, 100], 250) == [(0, 1), (1, 3)]  # a longer sequence goes alone
    assert token_packs([100, 100], 200) == [(0, 2)]
    assert token_packs([50], 10) == [(0, 1)]


def test_mixed_batch_gives_the_same_logprobs_as_each_environment_alone(tiny, prompts, easy_games):
    policy, tokenizer = tiny
    games = easy_games[:8]

    def greedy(paths):
        decoder = ConstrainedDecoder(policy)
        episodes, _ = decode_episodes([TextGame(p, 8) for p in paths], [decoder], prompts)
        return episodes

    together = greedy(games)
    assert len({e.length for e in together}) > 1 or any(e.length > 1 for e in together)  # rows really differ
    for path, mixed in zip(games, together):
        (alone,) = greedy([path])
        assert [s.action.command for s in alone.steps] == [s.action.command for s in mixed.steps]
        for a, m in zip(alone.steps, mixed.steps):
            for da, dm in zip(a.action.decisions, m.action.decisions):
                assert dm.logprob == pytest.approx(da.logprob, abs=1e-5)
                assert dm.value == pytest.approx(da.value, abs=1e-5)


def test_sampled_commands_depend_only_on_the_episode_seed_not_on_the_batch(tiny, prompts, easy_games):
    """The sampling path: one CPU generator per episode, drawing from the few allowed probabilities
    (docs/gpu.md). A game sampled alone, in a batch, or in another batch order plays the same
    commands; another seed plays other ones."""
    from textrl.rollout import episode_seeds

    policy, tokenizer = tiny
    games = easy_games[:6]
    seeds = episode_seeds(7, 3, games)

    def sample(indices, seed_of=lambda i: seeds[i]):
        decoder = ConstrainedDecoder(policy)
        episodes, _ = decode_episodes([TextGame(games[i], 8) for i in indices], [decoder], prompts,
                                      Sampling(1.5, [seed_of(i) for i in indices]))
        return {i: [s.action.command for s in e.steps] for i, e in zip(indices, episodes)}

    together = sample(range(6))
    assert sample([5, 3, 1]) == {i: together[i] for i in [5, 3, 1]}
    for i in [0, 4]:
        assert sample([i]) == {i: together[i]}
    assert episode_seeds(7, 3, [games[4], games[0]]) == [seeds[4], seeds[0]]  # a game's seed, not its slot
    other = sample(range(6), seed_of=lambda i: seeds[i] + 1)
    assert other != together


def fresh_forward(policy, step, decision, temperature):
    """(log-prob, value) of a decision from one uncached forward of prompt + command, as the update does."""
    ids = torch.tensor([step.prompt_ids + step.action.command_ids[: decision.index]])
    with torch.no_grad():
        hidden, _ = policy.hidden(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
        logits, value = policy.logits(hidden[0, -1]), float(policy.value(hidden[0, -1]))
    allowed = torch.zeros_like(logits, dtype=torch.bool)
    allowed[decision.allowed] = True
    return fork_logprobs(logits, allowed, temperature), value


def assert_matches_fresh_forward(policy, episodes, temperature):
    checked = 0
    for episode in episodes:
        for step in episode.steps:
            for d in step.action.decisions:
                logp, value = fresh_forward(policy, step, d, temperature)
                assert float(logp[d.token]) == pytest.approx(d.logprob, abs=1e-5)
                assert value == pytest.approx(d.value, abs=1e-5)
                allowed = logp[d.allowed]
                assert float(-(allowed.exp() * allowed).sum()) == pytest.approx(d.entropy, abs=1e-5)
                checked += 1
    return checked


def test_recorded_logprobs_match_a_fresh_full_forward(tiny, prompts, easy_games):
    policy, tokenizer = tiny
    decoder = ConstrainedDecoder(policy)
    episodes, stats = decode_episodes([TextGame(p, 8) for p in easy_games[:6]], [decoder], prompts,
                                      Sampling(0.7, list(range(6))))
    assert assert_matches_fresh_forward(policy, episodes, 0.7) == stats.decisions > 10


def test_truncated_history_drops_the_cached_row_and_stays_exact(tiny, easy_games):
    """With cut turns not kept in the cache (``env.drop_turns_from_cache=false``; tests/test_stream.py
    covers keeping them), a cut prompt is fed again from position 0: every decision equals a fresh
    forward of its prompt."""
    from textrl.games.prompt import PromptBuilder

    policy, tokenizer = tiny
    short = PromptBuilder(tokenizer, max_prompt_tokens=400)
    decoder = ConstrainedDecoder(policy, drop_cut_turns=False)
    episodes, stats = decode_episodes([TextGame(p, 8) for p in easy_games[4:7]], [decoder], short)
    restarts = sum(step.prompt_ids[: len(prev.prompt_ids)] != prev.prompt_ids
                   for e in episodes for prev, step in zip(e.steps, e.steps[1:]))
    assert restarts > 0  # the prompt really stopped extending the cached sequence
    assert assert_matches_fresh_forward(policy, episodes, 1.0) == stats.decisions


def test_a_row_restarting_beside_continuing_rows_stays_exact_and_keeps_no_dead_positions(tiny, prompts, easy_games):
    """Turn 2: rows 0 and 2 extend their turn-1 prompts, row 1 gets another game's prompt (as after
    a history truncation). Every decision must equal a fresh forward, and each row's cache must hold
    exactly its own tokens: not row 1's dead turn-1 positions, nor any padding."""
    policy, tokenizer = tiny
    decoder = ConstrainedDecoder(policy)
    envs = [TextGame(p, 8) for p in easy_games[:3]]
    first = []
    for env in envs:
        obs = env.reset()
        first.append((prompts.build(obs, env.history), trie_for(obs, prompts)))
    actions = decoder.act([0, 1, 2], [p for p, _ in first], [t for _, t in first], greedy=True)
    second = []
    for env, action in zip(envs, actions):
        obs = env.step(action.command).observation
        second.append((prompts.build(obs, env.history), trie_for(obs, prompts)))
    other = TextGame(easy_games[5], 8)
    obs = other.reset()
    second[1] = (prompts.build(obs, other.history), trie_for(obs, prompts))
    assert second[0][0][: len(first[0][0])] == first[0][0] and second[1][0][: len(first[1][0])] != first[1][0]
    turn2 = decoder.act([0, 1, 2], [p for p, _ in second], [t for _, t in second], greedy=True)
    for (prompt, _), action in zip(second, turn2):
        step = type("S", (), {"prompt_ids": prompt, "action": action})
        for d in action.decisions:
            logp, value = fresh_forward(policy, step, d, 1.0)
            assert float(logp[d.token]) == pytest.approx(d.logprob, abs=1e-5)
            assert value == pytest.approx(d.value, abs=1e-5)
    assert decoder.fed[1][: len(second[1][0])] == second[1][0]
    assert decoder.cache.lengths == [len(f) for f in decoder.fed]


def test_greedy_takes_the_most_likely_token_and_scores_sum_to_one(tiny, prompts, easy_games):
    policy, tokenizer = tiny
    env = TextGame(easy_games[3], 8)
    obs = env.reset()
    trie = trie_for(obs, prompts)
    prompt = prompts.build(obs, env.history)
    (action,) = ConstrainedDecoder(policy).act([0], [prompt], [trie], greedy=True)
    step = type("S", (), {"prompt_ids": prompt, "action": action})
    for d in action.decisions:
        logp, _ = fresh_forward(policy, step, d, 1.0)
        assert d.token == max(d.allowed, key=lambda t: float(logp[t]))
    probs = score_commands(policy, prompt, trie)
    assert set(probs) == set(obs.admissible_commands)
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4)
    assert probs[action.command] == pytest.approx(float(torch.tensor(action.logprob).exp()), abs=1e-5)


def test_scoring_the_steps_of_an_episode_with_a_kept_prompt_cache_equals_scoring_each_afresh(tiny, prompts, easy_games):
    policy, _ = tiny
    env = TextGame(easy_games[2], 8)
    obs, keep = env.reset(), PromptCache()
    fed = []
    hidden = policy.hidden
    for step in range(4):
        prompt, trie = prompts.build(obs, env.history), trie_for(obs, prompts)
        policy.hidden = lambda ids, *args: fed.append(ids.shape[1]) or hidden(ids, *args)
        try:
            kept = score_commands(policy, prompt, trie, keep)
        finally:
            del policy.hidden
        assert keep.ids == prompt
        assert fed[-2] == (len(prompt) if step == 0 else len(prompt) - len(previous))  # only the new tokens
        previous = prompt
        fresh = score_commands(policy, prompt, trie)
        assert kept.keys() == fresh.keys() and all(kept[c] == pytest.approx(fresh[c], abs=1e-5) for c in fresh)
        obs = env.step(max(fresh, key=fresh.get)).observation


@pytest.mark.parametrize("name, overrides", [("tiny", {"attn_implementation": "eager"}),
                                             ("gpt2", {"architecture": {"n_layer": 2}}),
                                             ("qwen", {"architecture": {"num_hidden_layers": 2}})])
def test_scoring_feeds_each_trie_node_once_and_gives_each_commands_fresh_forward(name, overrides, easy_games):
    """score_commands feeds the prompt, then every inner node of the trie once in one row (a tree
    mask: no copy of the prompt per command), and reads the forks' children's logits only. Each
    command's probability equals the product of its fork decisions from one uncached forward of
    prompt + command, for Llama under eager attention (an additive mask), GPT-2 (learned positions)
    and Qwen2 (GQA) alike."""
    from textrl.config import load_model_config
    from textrl.games.prompt import PromptBuilder
    from textrl.policy.model import build_policy

    policy, tokenizer = build_policy(load_model_config(name, source="random", **overrides))
    policy.eval()
    prompts = PromptBuilder(tokenizer)
    env = TextGame(easy_games[1], 8)
    obs = env.reset()
    prompt, trie = prompts.build(obs, env.history), trie_for(obs, prompts)
    calls, hidden, logits = [], policy.hidden, policy.logits
    policy.hidden = lambda ids, *args: calls.append(tuple(ids.shape)) or hidden(ids, *args)
    policy.logits = lambda *args: pytest.fail("the whole vocabulary's logits")
    keep = PromptCache()
    try:
        probs = score_commands(policy, prompt, trie, keep)
    finally:
        del policy.hidden, policy.logits
    inner = {tuple(ids[: k + 1]) for ids in trie.commands.values() for k in range(len(ids) - 1)}
    assert calls == [(1, len(prompt)), (1, len(inner))]
    assert len(inner) < sum(len(ids) - 1 for ids in trie.commands.values())  # shared prefixes fed once
    assert keep.cache.get_seq_length() == len(prompt)
    for command, ids in trie.commands.items():
        total = 0.0
        for k in trie.decisions(command):
            step = type("S", (), {"prompt_ids": prompt, "action": type("A", (), {"command_ids": ids})})
            children = trie.root
            for token in ids[:k]:
                children = children.children[token]
            logp, _ = fresh_forward(policy, step, type("D", (), {"index": k, "allowed": list(children.children)}), 1.0)
            total += float(logp[ids[k]])
        assert probs[command] == pytest.approx(math.exp(total), abs=1e-5), command
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4)


def test_scoring_under_an_attention_without_4d_masks_is_refused_naming_it():
    """Flex attention's mask is a BlockMask, not the tensor the tree call needs: a clear error, not
    the commands scored as if each saw the others."""
    from textrl.config import load_model_config
    from textrl.policy.decoding import tree_mask
    from textrl.policy.model import build_policy

    policy, _ = build_policy(load_model_config("tiny", attn_implementation="flex_attention"))
    with pytest.raises(ValueError, match="model.attn_implementation is 'flex_attention'"):
        tree_mask(policy, 5, [-1, 0, 0])


@pytest.mark.parametrize("name, layers", [("gpt2", {"n_layer": 2}), ("qwen", {"num_hidden_layers": 2})])
def test_gpt2_and_qwen_architectures_decode_exactly(name, layers, easy_games):
    """Their code paths (GPT-2: learned absolute positions; Qwen2: GQA + RoPE) with random weights."""
    from textrl.config import load_model_config
    from textrl.games.prompt import PromptBuilder
    from textrl.policy.model import build_policy

    policy, tokenizer = build_policy(load_model_config(name, source="random", architecture=layers))
    policy.eval()
    assert policy.lm.config.model_type == {"gpt2": "gpt2", "qwen": "qwen2"}[name]
    prompts = PromptBuilder(tokenizer)
    decoder = ConstrainedDecoder(policy)
    episodes, stats = decode_episodes([TextGame(p, 3) for p in easy_games[:3]], [decoder], prompts,
                                      Sampling(1.0, [0, 1, 2]))
    assert all(s.action.command in s.observation.admissible_commands for e in episodes for s in e.steps)
    assert assert_matches_fresh_forward(policy, episodes, 1.0) == stats.decisions > 0


def test_the_decode_profile_counts_every_real_token_fed_and_the_games_time(tiny, prompts, easy_games):
    """perf/rollout_tokens and the phase seconds: what the decoder fed, split into prompt and fork calls."""
    policy, tokenizer = tiny
    decoder = ConstrainedDecoder(policy)
    envs = [TextGame(p, 3) for p in easy_games[:4]]
    for env in envs:
        env.reset()
    obs = [env.observation for env in envs]
    prompt_ids = [prompts.build(o, env.history) for o, env in zip(obs, envs)]
    tries = [trie_for(o, prompts) for o in obs]
    rngs = [torch.Generator().manual_seed(i) for i in range(4)]
    actions = decoder.act(list(range(4)), prompt_ids, tries, rngs=rngs)
    p = decoder.profile
    # a fresh cache: everything fed is in decoder.fed; the prompts are fed first, in one call
    assert p.tokens == sum(len(f) for f in decoder.fed)
    assert p.prefill_tokens >= sum(len(x) for x in prompt_ids) and p.fork_tokens == p.tokens - p.prefill_tokens
    forks = max(len(a.decisions) for a in actions)  # one call per fork level after the first, fed or not
    assert 1 <= p.calls <= forks
    assert p.prefill_s > 0 and (p.fork_s > 0) == (p.calls > 1) and p.choose_s > 0

    episodes, stats = decode_episodes([TextGame(g, 3) for g in easy_games[:4]], [decoder], prompts, Sampling(1.0, [1, 2, 3, 4]))
    assert stats.decode == decoder.profile and stats.decode.tokens > 0
    assert 0 < stats.env_s and stats.env_s + stats.decode.model_s < stats.seconds


@pytest.mark.parametrize("name, layers, attention, pack_tokens", [
    ("tiny", {}, None, 1024), ("gpt2", {"n_layer": 2}, None, 1024), ("qwen", {"num_hidden_layers": 2}, None, 1024),
    ("tiny", {}, None, 300), ("tiny", {}, "eager", 1024), ("gpt2", {"n_layer": 2}, "eager", 1024)])
def test_the_updates_batched_forward_computes_each_sequence_as_alone(name, layers, attention, pack_tokens,
                                                                      easy_games, monkeypatch):
    """decision_forward packs a minibatch back to back under textrl's attention (in rows of up to
    ``PACK_TOKENS``: 300 makes several forwards of it), and pads it under any other (``eager``), with
    the 4-D mask built by itself for SDPA (padding_mask): either way every decision's logits and
    value equal those of its sequence fed alone, for Llama, GPT-2 (learned positions: each packed
    sequence from position 0) and Qwen2 (GQA) alike."""
    import textrl.ppo.sequences as sequences_module
    from textrl.config import load_model_config
    from textrl.games.prompt import PromptBuilder
    from textrl.policy.model import SDPA, build_policy
    from textrl.ppo.sequences import decision_forward, training_sequences

    torch.manual_seed(0)
    overrides = {"source": "random", "architecture": layers} if layers else {}
    policy, tokenizer = build_policy(load_model_config(name, **overrides, **({"attn_implementation": attention}
                                                                            if attention else {})))
    assert (policy.lm.config._attn_implementation == SDPA) == (attention is None)
    policy.eval()
    episodes, _ = decode_episodes([TextGame(p, 3) for p in easy_games[:3]], [ConstrainedDecoder(policy)],
                                  PromptBuilder(tokenizer), Sampling(1.0, [0, 1, 2]))
    sequences = training_sequences(episodes).sequences
    assert len({len(s.input_ids) for s in sequences}) > 1  # unequal: padded, or packed at several offsets
    monkeypatch.setattr(sequences_module, "PACK_TOKENS", pack_tokens)
    packs = sequences_module.token_packs([len(s.input_ids) for s in sequences], pack_tokens)
    assert (len(packs) > 1) == (pack_tokens < 1024)  # the small budget splits the batch, the default does not
    with torch.no_grad():
        together = decision_forward(policy, sequences, tokenizer.pad_token_id)
        alone = [decision_forward(policy, [s], tokenizer.pad_token_id) for s in sequences]
    width = together.logits.shape[1]
    logits = torch.cat([torch.nn.functional.pad(a.logits, (0, width - a.logits.shape[1])) for a in alone])
    valid = together.valid
    assert torch.allclose(together.logits[valid], logits[valid], atol=1e-4)
    assert torch.allclose(together.values, torch.cat([a.values for a in alone]), atol=1e-5)

"""Cut turns dropped from the rollout's KV cache (``textrl.policy.speed.stream``): the row holds exactly
its prompt, feeds only the new tokens, and the update's forward over the stream computes what the
rollout computed (checked against a forward with the dense mask those cuts mean, built here from
their definition), with the model's positions as the limit."""

from dataclasses import replace

import pytest
import torch

from textrl.config import load_env_config, load_model_config
from textrl.games.env import Observation, TextGame
from textrl.games.prompt import PromptBuilder
from textrl.policy.decoding import Action, ConstrainedDecoder, Decision, StreamPlace
from textrl.policy.distribution import fork_logprobs
from textrl.policy.model import build_policy
from textrl.policy.speed.ragged_cache import RaggedCache
from textrl.policy.speed.stream import Drop, blocks, find_cut
from textrl.ppo.sequences import decision_forward, training_sequences
from textrl.rollout import Episode, Player, Sampling, Step, decode_episodes, play_games


def dense_mask(length: int, drops) -> torch.Tensor:
    """[1, 1, L, L] bool: token i sees token j <= i unless a cut at or before i hid j."""
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    mask = j <= i
    for d in drops:
        mask &= ~((i >= d.at) & (j >= d.start) & (j < d.stop))
    return mask[None, None]


def masked_forward(policy, ids, drops):
    """Hidden states of a stream from one dense-masked forward (no stream layout involved)."""
    x = torch.tensor([ids])
    hidden, _ = policy.hidden(x, dense_mask(len(ids), drops), torch.arange(len(ids))[None])
    return hidden[0]


def test_find_cut_keeps_what_the_prompt_keeps_and_nothing_else():
    held = [1, 2, 10, 11, 20, 21, 30, 31]  # head 1 2, turns 10.., 20.., 30..
    assert find_cut(held, [1, 2, 20, 21, 30, 31, 40]) == (2, 4)  # the oldest turn cut
    assert find_cut(held, [1, 2, 30, 31, 40]) == (2, 6)
    assert find_cut(held, held + [40]) is None  # it extends: no cut
    assert find_cut(held, [1, 2, 40, 41]) is None  # nothing held is kept past the head: start again
    assert find_cut(held, [20, 21, 30, 31, 40]) == (0, 4)  # no head in common: the start is cut too
    assert find_cut(held, [1, 2, 20, 21, 30, 31]) is None  # no new token to feed
    # turns that begin alike (a chat template's header): the common start is kept from the cut turn
    assert find_cut([1, 7, 10, 7, 20, 7, 30], [1, 7, 20, 7, 30, 7, 40]) == (2, 4)


def test_a_sequence_is_the_stream_as_fed_even_where_the_next_prompt_leaves_out_an_unfed_command_tail():
    """The decoder never feeds a command's tokens after its last decision; the next prompt usually
    starts its new tokens with them, but a cut may keep a held suffix that the prompt continues
    otherwise (here: the whole history dropped, the held token 7 matching the prompt's). The
    sequence must follow the stream (``StreamPlace.start``), not the commands."""
    obs = Observation("goal", "room", "", "", ["a", "b"], 0.0, 1.0, False, False)
    first = Action("a", [7, 8, 9], [Decision(1, [8, 10], 8, -0.5, 0.0)], 1.0,
                   place=StreamPlace(True, 0, 3, ()))  # fed: 1 2 3 7 (the fork at 8 read after 7)
    second = Action("b", [10, 9], [Decision(0, [10, 11], 10, -0.7, 0.0)], 1.0,
                    place=StreamPlace(False, 4, 6, (Drop(4, 1, 3),)))  # held 1 7, new 5 6
    episode = Episode("game", [Step(obs, [1, 2, 3], first, 0.0, False, False, ""),
                               Step(obs, [1, 7, 5, 6], second, 0.0, False, False, "")])
    (seq,) = training_sequences([episode]).sequences
    assert seq.input_ids == [1, 2, 3, 7, 5, 6] and seq.positions == [3, 5] and seq.drops == (Drop(4, 1, 3),)


def test_blocks_list_the_keys_each_stretch_between_cuts_sees():
    assert blocks(10, (Drop(6, 2, 4), Drop(8, 4, 5))) == [
        (0, 6, [(0, 6)]), (6, 8, [(0, 2), (4, 8)]), (8, 10, [(0, 2), (5, 10)])]
    assert blocks(5, ()) == [(0, 5, [(0, 5)])]
    assert blocks(10, (Drop(6, 0, 3),)) == [(0, 6, [(0, 6)]), (6, 10, [(3, 10)])]  # the start cut


@pytest.mark.parametrize("batched", [False, True], ids=["per-row", "batched"])
@torch.no_grad()
def test_a_dropped_stretch_is_gone_from_the_cache_and_the_rest_computes_as_masked(tiny, prompts, easy_games,
                                                                                  batched):
    policy, _ = tiny
    rows = []
    for path in easy_games[:2]:
        env = TextGame(path, 8)
        env.reset()
        rows.append(prompts.build(env.observation, env.history) * 3)
    cache = RaggedCache(2, "cpu", batched=batched)
    plan = [(120, 90), (60, 0), (1, 40)]
    fed, outs = [0, 0], [[], []]

    def call(sizes):
        ids = [t for r, k in enumerate(sizes) for t in rows[r][fed[r]: fed[r] + k]]
        positions = [p for r, k in enumerate(sizes) for p in range(fed[r], fed[r] + k)]
        hidden = policy.hidden_packed(torch.tensor([ids]), torch.tensor([positions]), cache, list(sizes))[0]
        offset = 0
        for r, k in enumerate(sizes):
            outs[r].append(hidden[offset: offset + k])
            offset += k
            fed[r] += k

    for sizes in plan:
        call(sizes)
    # row 0 drops 20:100 of what it holds, row 1 5:50; then both go on (row 0 outgrows its stretch too)
    cache.drop(0, 20, 100)
    cache.drop(1, 5, 50)
    drops = [(Drop(fed[0], 20, 100),), (Drop(fed[1], 5, 50),)]
    assert cache.lengths == [fed[0] - 80, fed[1] - 45]
    call((130, 25))
    call((1, 1))
    for r in range(2):
        full = masked_forward(policy, rows[r][: fed[r]], drops[r])
        assert torch.allclose(torch.cat(outs[r]), full, atol=1e-5)
        # and the dense mask is not the causal one: the drop changed what the later tokens computed
        assert not torch.allclose(full[-1], masked_forward(policy, rows[r][: fed[r]], ())[-1], atol=1e-3)


def play(policy, tokenizer, games, history_len=2, max_steps=10, budget=4096):
    decoder = ConstrainedDecoder(policy, drop_cut_turns=True)  # env.drop_turns_from_cache=true
    prompts = PromptBuilder(tokenizer, max_prompt_tokens=budget)
    envs = [TextGame(p, max_steps, history_len=history_len) for p in games]
    episodes, _ = decode_episodes(envs, [decoder], prompts, Sampling(1.0, list(range(len(games)))))
    return episodes, decoder


def test_a_cut_history_feeds_only_new_tokens_and_the_update_reproduces_every_log_prob(tiny, easy_games):
    """history_len=2: every turn from the third cuts the oldest one. The stream holds each prompt
    exactly (its tokens at the positions the decisions read), the decoder fed far fewer tokens than
    re-feeding each cut prompt from position 0, and one forward over each stream gives the
    rollout's log-probs (ratio 1) and the dense-masked forward's hidden states."""
    policy, tokenizer = tiny
    episodes, decoder = play(policy, tokenizer, easy_games[:4])
    rollout = training_sequences(episodes)
    assert any(s.drops for s in rollout.sequences)

    refed, previous, k = 0, {}, 0
    for e, episode in enumerate(episodes):
        for step in episode.steps:
            prompt, place = step.prompt_ids, step.action.place
            before = previous.get(e)
            refed += len(prompt) - len(before) if before and prompt[: len(before)] == before else len(prompt)
            previous[e] = prompt + step.action.command_ids
            if not step.action.decisions:
                continue
            # what the stream shows the turn's first decision is exactly its prompt, in order
            s = next(s for s in rollout.sequences if k in s.decisions)
            k += len(step.action.decisions)
            visible = dense_mask(place.offset, s.drops)[0, 0, -1].tolist()
            assert [t for t, v in zip(s.input_ids, visible) if v] == prompt
    fed = decoder.counts["prefill_tokens"] + decoder.counts["fork_tokens"]
    commands = sum(len(s.action.command_ids) for e in episodes for s in e.steps)
    assert fed < 0.8 * (refed + commands)

    for s in rollout.sequences:
        out = decision_forward(policy, [s], tokenizer.pad_token_id)
        logp = fork_logprobs(out.logits, out.valid, 1.0).gather(1, out.chosen[:, None])[:, 0]
        assert torch.allclose(logp, rollout.logprobs[out.decisions], atol=1e-5)
        full = masked_forward(policy, s.input_ids, s.drops)
        assert torch.allclose(policy.value(full[s.positions]), out.values, atol=1e-5)
    # a batch of unequal streams, padded: the same
    batch = rollout.sequences[:3]
    out = decision_forward(policy, batch, tokenizer.pad_token_id)
    logp = fork_logprobs(out.logits, out.valid, 1.0).gather(1, out.chosen[:, None])[:, 0]
    assert torch.allclose(logp, rollout.logprobs[out.decisions], atol=1e-5)


def test_a_stream_that_would_pass_the_models_positions_starts_again_from_position_0(easy_games):
    """A model with 700 positions: cuts keep the stream growing, so rows start again before a
    prompt and its longest command would pass position 700 (more often than the same model with
    4,096 positions does, on the same games); every sequence stays within it."""
    def starts(positions):
        torch.manual_seed(0)
        policy, tokenizer = build_policy(load_model_config("tiny", architecture={"max_position_embeddings": positions}))
        policy.eval()
        episodes, _ = play(policy, tokenizer, easy_games[4:8], max_steps=12, budget=600)
        return policy, tokenizer, episodes, sum(s.action.place.new for e in episodes for s in e.steps)

    *_, unlimited = starts(4096)
    policy, tokenizer, episodes, limited = starts(700)
    rollout = training_sequences(episodes)
    assert any(s.drops for s in rollout.sequences)  # cuts were kept...
    assert limited > unlimited  # ...and rows started again at the limit
    assert max(len(s.input_ids) for s in rollout.sequences) <= 700
    with torch.no_grad():
        out = decision_forward(policy, rollout.sequences, tokenizer.pad_token_id)
    logp = fork_logprobs(out.logits, out.valid, 1.0).gather(1, out.chosen[:, None])[:, 0]
    assert torch.allclose(logp, rollout.logprobs[out.decisions], atol=1e-5)


def test_cuts_are_kept_only_under_the_attention_the_update_reproduces_them_with(tiny, easy_games):
    """With another attention implementation (model.attn_implementation) the update's forward
    could not hide the cut turns, so the decoder starts cut rows again from position 0."""
    policy, tokenizer = tiny
    saved = policy.lm.config._attn_implementation
    policy.lm.config._attn_implementation = "eager"
    try:
        episodes, _ = play(policy, tokenizer, easy_games[:2])
    finally:
        policy.lm.config._attn_implementation = saved
    rollout = training_sequences(episodes)
    assert not any(s.drops for s in rollout.sequences) and len(rollout.sequences) > len(episodes)


def test_gradient_checkpointing_recomputes_the_stream_attention(easy_games):
    """The stream layout reaches attention as an argument, so gradient checkpointing's second
    forward (run during backward) hides the cut turns too: the same gradient as without it."""
    torch.manual_seed(0)
    policy, tokenizer = build_policy(load_model_config("tiny"))
    policy.eval()
    episodes, _ = play(policy, tokenizer, easy_games[:2])
    batch = [s for s in training_sequences(episodes).sequences if s.drops][:2]
    assert batch

    def gradient():
        policy.zero_grad()
        out = decision_forward(policy, batch, tokenizer.pad_token_id)
        (fork_logprobs(out.logits, out.valid, 1.0).gather(1, out.chosen[:, None]).sum() + out.values.sum()).backward()
        return [p.grad.clone() for p in policy.lm.parameters() if p.grad is not None]

    policy.train()
    plain = gradient()
    policy.lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        checkpointed = gradient()
    finally:
        policy.lm.gradient_checkpointing_disable()
    assert len(plain) == len(checkpointed) > 0
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, checkpointed))


@pytest.mark.parametrize("drop", [True, False])
def test_env_drop_turns_from_cache_switches_the_cuts_for_training_and_evaluation(tiny, easy_games, drop):
    """Decoders made for the env's setting (training rollouts, evaluation, textrl-eval) follow it:
    false feeds a cut prompt again from position 0, one sequence per start. ``play_games`` refuses
    decoders made for the other setting rather than change them."""
    policy, tokenizer = tiny
    env = replace(load_env_config("easy"), history_len=2, max_steps=10, drop_turns_from_cache=drop)
    player = Player(policy, tokenizer, [ConstrainedDecoder(policy, drop_cut_turns=drop)])  # made for env's setting
    episodes, _ = play_games(player, easy_games[:2], env, Sampling(1.0, [0, 1]))
    sequences = training_sequences(episodes).sequences
    assert any(s.drops for s in sequences) == drop
    assert (len(sequences) == len(episodes)) == drop
    other = [ConstrainedDecoder(policy, drop_cut_turns=not drop)]
    with pytest.raises(ValueError, match=f"made with drop_cut_turns={{{not drop}}}"):
        play_games(Player(policy, tokenizer, other), easy_games[:1], env)
    assert other[0].drop_cut_turns is not drop

"""Batched, trie-constrained decoding with a persistent KV cache.

``ConstrainedDecoder.act`` picks one admissible command for every live environment at once:

1. Each environment's prompt is fed once. The cache persists across turns of an episode, so when
   the new prompt extends what the row already holds (the prompt builder makes prompts append-only
   until history is cut), only the new tokens are fed. When the history was cut, the cut turns are
   dropped from the row's cache and again only the new tokens are fed (``textrl.policy.speed.stream``);
   a row whose prompt is neither (a new episode, a history cut to nothing, a stream at the model's
   positions, or cuts switched off) starts again from position 0, in the same call.
2. Rows then advance in lockstep, one model call per fork level: each call feeds every row's
   pending tokens (the token just chosen plus the forced single-child chain after it) and reads the
   hidden state after each row's last one.
   Every call is packed: the rows' tokens back to back in one sequence, with their own position ids,
   over a ``RaggedCache`` in which each row attends to its own positions only
   (``textrl.policy.speed.ragged_cache``). The linear layers compute no padding (on a CPU nothing does;
   on a GPU attention alone runs padded) and the cache has no holes, so every row computes what it
   would compute alone (pinned by the tests).
3. At a fork the logits of the allowed children are divided by the temperature and sampled (argmax
   when greedy). The recorded log-prob is ``log_softmax(logits[allowed] / T)[chosen]`` -- exactly
   what the PPO update recomputes from the same token ids, masks and temperature (T = 1 for greedy).
   With exploration (``ppo.explore`` = e > 0) the policy *is* the mixture (1 - e) softmax + e uniform
   over the fork's children, in the rollout and in the update alike (``mix_uniform``), so PPO stays
   on-policy and no admissible child's probability falls below e / children.
   Each row samples with its own CPU generator, on the CPU, from the few allowed probabilities:
   the draw works whatever device the model is on, and a row's command depends on its own seed,
   not on which other rows share the batch.

With ``capture`` (a ``FrozenPrefix``: the model's lower blocks are frozen), every call of a rollout
that records (``reset(record=True)``: training's sampled rollouts) also keeps the last frozen block's output at each row's real tokens, and each action carries its row's tokens and
outputs so far (``Action.prefix_output``). The update then replays them (``training_sequences``) instead of
running the frozen blocks over the whole rollout a second time to recompute the old log-probs: the
rollout already computed exactly that function of the same tokens and positions.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields

import torch

from textrl.policy.device import PhaseTimer, ints_to_device
from textrl.policy.distribution import Forks, entropy, fork_logprobs, fork_parts
from textrl.policy.speed import Drop, FrozenPrefix, RaggedCache, find_cut, runs
from textrl.policy.model import SDPA, PolicyValueModel
from textrl.policy.trie import CommandTrie, TrieNode


@dataclass
class Decision:
    """One sampled token at a fork of the command trie."""

    index: int  # position of the chosen token in Action.command_ids
    allowed: list[int]  # the fork's children, sorted
    token: int
    logprob: float  # under softmax(logits[allowed] / temperature)
    value: float  # value estimate of the state at this fork
    entropy: float = 0.0  # of the fork's distribution (at the temperature): how undecided the choice was


@dataclass
class Action:
    command: str
    command_ids: list[int]  # command tokens + end token, as fed after the prompt
    decisions: list[Decision]
    temperature: float
    # with the decoder's ``capture``: every token of its row's stream (this prompt's tokens, the earlier
    # turns, cut ones included, this command up to its last fork) and the last frozen block's outputs
    # over them, in pieces; ``training_sequences`` takes them over (and sets this back to None)
    prefix_output: tuple[list[int], list[torch.Tensor]] | None = field(default=None, compare=False, repr=False)
    # where the decoder put this turn in its row's stream (``textrl.policy.speed.stream``); None for an
    # action it did not decode (``forced_action``)
    place: "StreamPlace | None" = field(default=None, compare=False, repr=False)

    @property
    def logprob(self) -> float:
        return sum(d.logprob for d in self.decisions)


@dataclass(frozen=True)
class StreamPlace:
    """Where an action's command sits in its row's stream: what the update needs to replay the
    row's cache (``training_sequences``)."""

    new: bool  # the row started a new stream (position 0) for this prompt
    start: int  # the stream's length before this prompt's new tokens: what was fed up to here
    offset: int  # the stream position of the command's first token (the prompt's length in the stream)
    drops: tuple[Drop, ...]  # the stream's cuts so far


@dataclass
class DecodeProfile:
    """Where a rollout's decoding time goes (``perf/rollout_*`` metrics, ``bench/iteration.py``).
    Measured on the device's clock (``PhaseTimer``: CUDA events on a GPU, where the host's clock
    would stop when the kernels are queued)."""

    prefill_s: float = 0.0  # model calls feeding prompts: the new observation and the forced tokens up to the first fork
    prefill_tokens: int = 0  # real tokens those calls fed (padding left out)
    fork_s: float = 0.0  # model calls feeding the token chosen at a fork and the forced chain after it
    fork_tokens: int = 0
    calls: int = 0  # model calls of both kinds
    choose_s: float = 0.0  # reading the allowed children's logits and drawing

    @classmethod
    def combined(cls, profiles: list["DecodeProfile"]) -> "DecodeProfile":
        """The sum of several decoders' profiles (one rollout decoded in groups)."""
        return cls(**{f.name: sum(getattr(p, f.name) for p in profiles) for f in fields(cls)})

    @property
    def model_s(self) -> float:
        return self.prefill_s + self.fork_s + self.choose_s

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.fork_tokens


class ConstrainedDecoder:
    """Decodes admissible commands for a batch of environment slots, keeping their KV cache between turns.

    Call ``reset()`` when a new set of episodes starts. Slots may drop out between calls (finished
    episodes); a slot that was not in the previous call resets the cache.
    """

    def __init__(self, policy: PolicyValueModel, batched: bool | None = None, capture: FrozenPrefix | None = None,
                 drop_cut_turns: bool = False):
        self.policy = policy
        # one padded attention call per layer (a GPU's layout) or one per row (a CPU's); None: by device
        self.batched = batched
        self.capture = capture  # keep the frozen blocks' outputs in rollouts that record (module docstring)
        # a cut history drops the cut turns from the cache (``_cut``): env.drop_turns_from_cache of
        # the games it plays (``play_games`` checks that they agree)
        self.drop_cut_turns = drop_cut_turns
        self.reset()

    def reset(self, record: bool = False) -> None:
        """Start a new set of episodes, with an empty cache; ``record``: keep the frozen blocks'
        outputs in this one (with ``capture``: a training rollout, which the update replays)."""
        self.recording = record and self.capture is not None
        self.cache: RaggedCache | None = None
        self.slots: list = []
        self.fed: list[list[int]] = []  # each row's stream: every token fed since it started at position 0
        self.held: list[list[int]] = []  # the tokens each row's cache holds (its stream less the cut turns)
        self.held_at: list[list[int]] = []  # their stream positions
        self.drops: list[list[Drop]] = []  # each row's cuts (``textrl.policy.speed.stream``)
        self.places: list[StreamPlace | None] = []  # each row's latest prompt's place in its stream
        self.captured: list[list[torch.Tensor]] = []  # with ``capture``: the frozen output at each of them
        # new ones: decode_episodes() reads the finished profile before the next reset
        self._timer: PhaseTimer | None = None
        self.counts = {"prefill_tokens": 0, "fork_tokens": 0, "calls": 0}

    @property
    def timer(self) -> PhaseTimer:
        """The rollout's phase timer, on the device the policy is on when the rollout starts (a
        decoder is built before Lightning moves the policy to its GPU)."""
        if self._timer is None:
            self._timer = PhaseTimer(self.device)
        return self._timer

    @property
    def profile(self) -> DecodeProfile:
        """This rollout's profile so far (on CUDA, reading it waits for the queued calls)."""
        return DecodeProfile(prefill_s=self.timer.seconds("prefill"), fork_s=self.timer.seconds("fork"),
                             choose_s=self.timer.seconds("choose"), **self.counts)

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def _select(self, slots: list) -> None:
        if self.cache is None or not set(slots) <= set(self.slots):
            # one padded attention call per layer on a GPU, one per row elsewhere (ragged_cache docstring)
            batched = self.device.type != "cpu" if self.batched is None else self.batched
            self.cache = RaggedCache(len(slots), self.device, batched=batched)
            for name in ("fed", "held", "held_at", "drops", "captured"):
                setattr(self, name, [[] for _ in slots])
            self.places = [None] * len(slots)
        elif slots != self.slots:
            row_of = {s: r for r, s in enumerate(self.slots)}  # not list.index: rows x rows lookups
            rows = [row_of[s] for s in slots]
            self.cache.select(rows)
            for name in ("fed", "held", "held_at", "drops", "captured", "places"):
                setattr(self, name, [getattr(self, name)[r] for r in rows])
        self.slots = list(slots)

    def _feed(self, chunks: list[list[int]], phase: str, rows: list[int],
              forks: list[list[int]] | None = None) -> tuple[torch.Tensor, Forks | None]:
        """Append each row's tokens to its cache in one packed model call, timed and counted under
        ``phase`` ("prefill" or "fork"); return the hidden state after the last token of each of
        ``rows`` (each fed at least one token), and with ``forks`` (those rows' next forks'
        children) their ``Forks`` on the device. In a rollout that records, the frozen output at
        each token is appended to its row's ``captured``.

        Everything the call needs from the host -- token ids, positions, the cache's layout, which
        hidden states to read, the forks' children -- goes to the device in one copy
        (``ints_to_device``): one host-to-device transfer per call."""
        new = [len(c) for c in chunks]
        ends = list(itertools.accumulate(new))
        layout = self.cache.layout(new)
        parts = {"ids": [t for c in chunks for t in c],
                 "positions": [k for f, c in zip(self.fed, chunks) for k in range(len(f), len(f) + len(c))],
                 "last": [ends[r] - 1 for r in rows]}
        if forks is not None:
            parts.update(fork_parts(forks))
        parts.update({f"cache.{k}": v for k, v in layout.parts.items()})
        ints = ints_to_device(parts, self.device)
        cache_ints = {k.removeprefix("cache."): v for k, v in ints.items() if k.startswith("cache.")}
        with self.timer.phase(phase):
            if not self.recording:
                hidden = self.policy.hidden_packed(ints["ids"][None], ints["positions"][None], self.cache, layout,
                                                   cache_ints)
            else:
                with self.capture.record() as recorded:
                    hidden = self.policy.hidden_packed(ints["ids"][None], ints["positions"][None], self.cache,
                                                       layout, cache_ints)
                output = self.capture.recorded_output(recorded)[0]
                offset = 0
                for r, n in enumerate(new):  # views: the packed output holds real tokens only
                    if n:
                        self.captured[r].append(output[offset:offset + n])
                    offset += n
        self.counts[f"{phase}_tokens"] += len(parts["ids"])
        self.counts["calls"] += 1
        for fed, held, held_at, chunk in zip(self.fed, self.held, self.held_at, chunks):
            held_at.extend(range(len(fed), len(fed) + len(chunk)))
            held.extend(chunk)
            fed.extend(chunk)
        return hidden[0, ints["last"]], (Forks.on_device(forks, ints) if forks is not None else None)

    def _prefill(self, slots: list, prompts: list[list[int]], cursors: list["Cursor"], rows: list[int],
                 forks: list[list[int]] | None) -> tuple[torch.Tensor, Forks | None]:
        """Feed each row what its cache lacks of its prompt, plus the forced tokens up to its first
        fork; return ``_feed``'s hidden states there for ``rows`` (the state the first decision and
        its value read). A row whose history was cut drops the cut turns (``_cut``); a row whose
        prompt neither extends nor cuts what it holds starts again from position 0, in the same call."""
        self._select(slots)
        pending = []
        for r, (prompt, cursor) in enumerate(zip(prompts, cursors)):
            held = self.held[r]
            extends = len(prompt) > len(held) and prompt[: len(held)] == held
            if not (self._fits(r, len(prompt) - len(held), cursor) if extends else self._cut(r, prompt, cursor)):
                self.cache.restart(r)
                for name in ("fed", "held", "held_at", "drops", "captured"):
                    getattr(self, name)[r] = []
            new = list(prompt[len(self.held[r]):])
            self.places[r] = StreamPlace(not self.fed[r], len(self.fed[r]), len(self.fed[r]) + len(new),
                                         tuple(self.drops[r]))
            pending.append(new + cursor.new)
        return self._feed(pending, "prefill", rows, forks)

    def _cut(self, r: int, prompt: list[int], cursor: "Cursor") -> bool:
        """Drop from row r's cache the turns its history cut, if ``prompt`` is what it holds less a
        stretch, plus new tokens (``find_cut``), and the stream then still fits the model's
        positions with the longest command; False (nothing dropped) otherwise, or where the update
        could not reproduce the cut (an attention implementation other than textrl's SDPA), or
        with ``drop_cut_turns`` off."""
        if not self.drop_cut_turns or self.policy.lm.config._attn_implementation != SDPA or not self.held[r]:
            return False
        cut = find_cut(self.held[r], prompt)
        if cut is None:
            return False
        s, e = cut
        if not self._fits(r, len(prompt) - (len(self.held[r]) - (e - s)), cursor):
            return False
        at = len(self.fed[r])
        self.drops[r] += [Drop(at, a, b) for a, b in runs(self.held_at[r][s:e])]
        del self.held[r][s:e], self.held_at[r][s:e]
        self.cache.drop(r, s, e)
        return True

    def _fits(self, r: int, new: int, cursor: "Cursor") -> bool:
        """Whether row r's stream, with ``new`` more prompt tokens and the longest command after
        them, stays within the model's positions (a stream with cuts counts more positions than it
        holds tokens)."""
        limit = self.policy.position_limit
        longest = max(len(ids) for ids in cursor.trie.commands.values())
        return limit is None or len(self.fed[r]) + new + longest <= limit

    @torch.no_grad()
    def act(self, slots: list, prompts: list[list[int]], tries: list[CommandTrie], temperature: float = 1.0,
            greedy: bool = False, rngs: list[torch.Generator] | None = None, explore: float = 0.0) -> list[Action]:
        """One command per row. Sampling draws each row's randomness from its own CPU generator
        ``rngs[row]``, so a row's command depends on its generator alone, never on the batch.
        ``explore`` mixes each fork's distribution with uniform (``mix_uniform``; sampling only).

        One model call per fork level, and per call one copy to the device (``_feed``) and one back
        (``choose``): the rows still choosing and their forks' children are known on the host
        before the call that computes their hidden states."""
        temperature = recorded_temperature(temperature, greedy)
        if not greedy and (rngs is None or len(rngs) != len(slots)):
            raise ValueError("sampling needs one torch.Generator per row (rngs), or greedy=True")
        cursors = [Cursor(trie) for trie in tries]
        live = [r for r, c in enumerate(cursors) if not c.done]
        hidden, forks = self._prefill(slots, prompts, cursors, live, [cursors[r].children for r in live] or None)
        while live:
            with self.timer.phase("choose"):
                choose(self.policy, hidden, forks, [cursors[r] for r in live], temperature, greedy,
                       None if greedy else [rngs[r] for r in live], 0.0 if greedy else explore)
            chunks = [c.new if not c.done else [] for c in cursors]
            if not any(chunks):
                break
            live = [r for r, c in enumerate(cursors) if not c.done]
            hidden, forks = self._feed(chunks, "fork", live, [cursors[r].children for r in live] or None)
        actions = [c.action(temperature) for c in cursors]
        for action, place in zip(actions, self.places):
            action.place = place
        if self.recording:
            for action, fed, captured in zip(actions, self.fed, self.captured):
                action.prefix_output = (list(fed), list(captured))
        return actions

    @torch.no_grad()
    def values(self, slots: list, prompts: list[list[int]], tries: list[CommandTrie]) -> list[float]:
        """The value estimate of each row's state, read where its first decision would be: the
        bootstrap value of an episode cut by the step limit."""
        cursors = [Cursor(trie) for trie in tries]
        hidden, _ = self._prefill(slots, prompts, cursors, list(range(len(slots))), None)
        return self.policy.value(hidden).float().tolist()


def recorded_temperature(temperature: float, greedy: bool) -> float:
    """The temperature the log-probs are recorded at: T for sampling, 1 for greedy."""
    if greedy:
        return 1.0
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    return float(temperature)


class Cursor:
    """One row's walk down its command trie: the tokens so far, the decisions, what to feed next."""

    def __init__(self, trie: CommandTrie):
        self.trie = trie
        forced, self.node = trie.advance(trie.root)
        self.ids = list(forced)
        self.decisions: list[Decision] = []
        self.new = [] if self.done else forced  # tokens the model has not seen yet

    @property
    def done(self) -> bool:
        return self.node.command is not None

    @property
    def children(self) -> list[int]:
        """The current fork's children, sorted (the order the decision records)."""
        return sorted(self.node.children)

    def choose(self, token: int, logprob: float, value: float, entropy: float = 0.0) -> None:
        self.decisions.append(Decision(len(self.ids), self.children, token, logprob, value, entropy))
        self.ids.append(token)
        node = self.node.children[token]
        forced, self.node = self.trie.advance(node) if token != self.trie.end_id else ([], node)
        self.ids += forced
        self.new = [token] + forced

    def action(self, temperature: float) -> Action:
        return Action(self.node.command, self.ids, self.decisions, temperature)


def forced_action(trie: CommandTrie, command: str) -> Action:
    """``command`` walked down its trie as if chosen: the same decisions (forks, allowed children,
    tokens) the decoder would record had it sampled it, with no log-prob or value (T = 1). The
    walkthrough warm start trains on these."""
    ids = trie.commands[command]
    cursor = Cursor(trie)
    while not cursor.done:
        cursor.choose(ids[len(cursor.ids)], 0.0, 0.0)
    return cursor.action(1.0)


def choose(policy: PolicyValueModel, last: torch.Tensor, forks: Forks, cursors: list[Cursor], temperature: float,
           greedy: bool, rngs: list[torch.Generator] | None, explore: float = 0.0) -> None:
    """Sample (or take the argmax of) each cursor's fork from the hidden states ``last`` and advance it.

    Only the fork's children's logits are computed (``PolicyValueModel.logits_of``), on the device;
    the values, entropies and log-probs come to the host in one copy (``.tolist()``), where each
    row draws from its own CPU generator. The log-probs are ``log_softmax(logits[allowed] / T)``,
    what the update recomputes over the same allowed set.
    """
    logp = fork_logprobs(policy.logits_of(last, forks.index), forks.valid, temperature, explore)
    table = torch.cat([policy.value(last).float()[:, None], entropy(logp)[:, None], logp], dim=1).tolist()
    for cursor, row, n, rng in zip(cursors, table, forks.sizes, rngs or [None] * len(cursors)):
        value, spread, lp = row[0], row[1], row[2: 2 + n]
        if greedy:
            k = max(range(n), key=lambda j: lp[j])  # the first of equal maxima, as argmax
        else:  # inverse CDF with one uniform draw from this row's generator
            cdf = torch.tensor(lp, dtype=torch.float64).exp().cumsum(0)
            u = torch.rand((), generator=rng, dtype=torch.float64) * cdf[-1]
            k = min(int(torch.searchsorted(cdf, u, right=True)), n - 1)
        cursor.choose(cursor.children[k], lp[k], value, spread)


class PromptCache:
    """The KV cache of the last prompt ``score_commands`` fed, for the next prompt of the same
    episode: that prompt extends this one, so only its new tokens are fed (one per episode)."""

    def __init__(self):
        self.ids: list[int] = []
        self.cache = None


@torch.no_grad()
def score_commands(policy: PolicyValueModel, prompt: list[int], trie: CommandTrie,
                   keep: PromptCache | None = None) -> dict[str, float]:
    """Probability (T = 1) of every command in the trie: the product of its fork decisions.

    The prompt is fed once. The trie's inner nodes (every token a command feeds after the prompt)
    then go in one call, each node once, each attending to the prompt and its own ancestors only
    (``tree_mask``): one copy of the prompt's cache, not one per command, and logits for the forks'
    children only (``logits_of``), never the whole vocabulary. With ``keep``, a prompt that extends
    the one ``keep`` holds feeds only its new tokens, and ``keep`` then holds this prompt.
    """
    with policy.weights_cast_once():  # under autocast: each weight cast once, autocast's cache off
        return _score_commands(policy, prompt, trie, keep)


def _score_commands(policy: PolicyValueModel, prompt: list[int], trie: CommandTrie,
                    keep: PromptCache | None) -> dict[str, float]:
    device = next(policy.parameters()).device
    reuse = keep is not None and keep.cache is not None and len(prompt) > len(keep.ids) \
        and prompt[: len(keep.ids)] == keep.ids
    start = len(keep.ids) if reuse else 0
    cache = keep.cache if reuse else policy.new_cache()
    ones = torch.ones(1, len(prompt), dtype=torch.long, device=device)
    hidden, cache = policy.hidden(torch.tensor([prompt[start:]], device=device), ones,
                                  torch.arange(start, len(prompt), device=device)[None], cache)
    states = [hidden[0, -1:]]  # row 0: the state at the root, after the prompt's last token
    inner = inner_nodes(trie)
    if inner:  # row 1 + i: the state after inner node i
        ids = torch.tensor([[token for _, token, _, _ in inner]], device=device)
        positions = len(prompt) + torch.tensor([[depth for _, _, depth, _ in inner]], device=device)
        tree, cache = policy.hidden(ids, tree_mask(policy, len(prompt), [p for *_, p in inner]), positions, cache)
        states.append(tree[0])
        cache.crop(-len(inner))  # the prompt's cache again, for the next prompt of the episode
    if keep is not None:
        keep.ids, keep.cache = list(prompt), cache
    rows, forks, fork_of = [], [], {}
    for row, node in enumerate([trie.root] + [node for node, *_ in inner]):
        if node.is_fork:
            fork_of[id(node)] = len(forks)
            rows.append(row)
            forks.append(list(node.children))
    if not forks:  # one command: nothing to choose
        return dict.fromkeys(trie.commands, 1.0)
    at = Forks.on_device(forks, ints_to_device(fork_parts(forks), device))
    logp = fork_logprobs(policy.logits_of(torch.cat(states)[rows], at.index), at.valid).tolist()
    out = {}
    for command, ids_c in trie.commands.items():
        node, total = trie.root, 0.0
        for token in ids_c:
            if node.is_fork:
                f = fork_of[id(node)]
                total += logp[f][forks[f].index(token)]
            node = node.children[token]
        out[command] = math.exp(total)
    return out


def inner_nodes(trie: CommandTrie) -> list[tuple[TrieNode, int, int, int]]:
    """Every node below the root that has children (all but the leaves the end token reaches),
    depth first: (node, its token, its depth from 0, its parent's index here or -1 for the root)."""
    out = []

    def visit(node: TrieNode, depth: int, parent: int) -> None:
        for token, child in node.children.items():
            if child.children:
                out.append((child, token, depth, parent))
                visit(child, depth + 1, len(out) - 1)

    visit(trie.root, 0, -1)
    return out


def tree_mask(policy: PolicyValueModel, prompt_len: int, parents: list[int]) -> torch.Tensor:
    """The attention mask of nodes fed after a cached prompt, node i seeing the prompt, its
    ancestors and itself (``parents[i]``: its parent's index, -1 for the root), in the format of the
    model's attention implementation (transformers' mask interface: a bool mask for SDPA, an
    additive one for eager)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # slow import: see load_lm

    device = next(policy.parameters()).device
    n = len(parents)
    sees = torch.zeros(n, prompt_len + n, dtype=torch.bool)
    sees[:, :prompt_len] = True
    for i, p in enumerate(parents):
        if p >= 0:
            sees[i] = sees[p]
        sees[i, prompt_len + i] = True
    sees = sees.to(device)
    config = policy.lm.config
    implementation = config._attn_implementation
    mask = ALL_MASK_ATTENTION_FUNCTIONS[implementation](
        batch_size=1, q_length=n, kv_length=prompt_len + n, mask_function=lambda b, h, q, kv: sees[q, kv],
        allow_is_causal_skip=False, dtype=torch.float32, config=config, device=device)
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 4):
        raise ValueError(f"scoring commands needs an attention implementation that takes a 4D mask (textrl's "
                         f"SDPA, sdpa, eager); model.attn_implementation is {implementation!r}")
    return mask

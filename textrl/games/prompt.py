"""Observation + history -> prompt token ids.

The prompt is a chat: a system message with the instructions and the game's objective, then one
(user: observation, assistant: command) pair per past turn, then the current observation. With a
chat template the tokenizer's own template renders it; without one (GPT-2) a plain transcript is
used. Past commands are inserted as their exact trie token ids (command tokens + end token), never
re-tokenized from text, so the sequence the PPO update sees is bit-for-bit the one that was sampled,
and the prompt of turn t+1 extends the prompt of turn t plus its command: the decoder reuses the KV
cache of that shared prefix. When the prompt exceeds ``max_prompt_tokens`` the oldest turns are
dropped first, ``DROP_BLOCK`` turns at a time, so that the next few prompts extend this one again
(the decoder drops cut turns from its cache either way, ``textrl.policy.speed.stream``; a block keeps
cuts rare), passing over the answers ``env.keep_answers`` keeps (``drop_oldest``); the system
message (with the objective) and the current observation always stay.
"""

from __future__ import annotations

from collections.abc import Sequence

from textrl.config import COMMAND_ROOM
from textrl.games.env import Observation, Turn, drop_oldest
from textrl.policy.trie import CommandTrie

SYSTEM = "You are playing a text adventure game. Reply with exactly one command.\nGoal: {objective}"
_SENTINEL = "\u0000TEXTRL_COMMAND\u0000"


class PromptTooLongError(ValueError):
    pass


def observation_text(obs: Observation, list_commands: bool = False, goal_last: bool = False) -> str:
    """What the agent is shown for one observation."""
    parts = [obs.feedback] if obs.feedback else []
    header = obs.description.splitlines()[0] if obs.description else ""
    if not (header and header in obs.feedback):  # "go"/"look" feedback already holds the room
        parts.append(obs.description)
    parts.append(obs.inventory)
    if list_commands:
        parts.append("Commands: " + ", ".join(obs.admissible_commands))
    if goal_last:
        parts.append("Goal: " + obs.objective)
    return "\n\n".join(p for p in parts if p)


class PromptBuilder:
    DROP_BLOCK = 4  # turns dropped at once when over max_prompt_tokens

    def __init__(self, tokenizer, max_prompt_tokens: int = 1024, list_commands: bool = False, goal_last: bool = False,
                 keep_answers: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.keep_answers = tuple(keep_answers)  # cuts pass over these verbs' latest answers, as Game's do
        self.max_prompt_tokens = max_prompt_tokens
        self.list_commands = list_commands
        # the objective again at the end of every observation, right before the command is chosen:
        # a small model attends to the last few hundred tokens far more than to the system message
        self.goal_last = goal_last
        self.chat = bool(getattr(tokenizer, "chat_template", None))
        self.end_id = self._end_token_id()
        # Plain transcripts put commands after "> ", so they are tokenized with a leading space.
        self._command_prefix = "" if self.chat else " "
        self._encoded: dict[str, tuple[int, ...]] = {}  # _encode's memo

    def _end_token_id(self) -> int:
        """The token that ends an assistant turn: the template's end-of-turn token if it is a single
        special token (``<|im_end|>`` for ChatML), else EOS."""
        tok = self.tokenizer
        if self.chat:
            text = tok.apply_chat_template(
                [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}], tokenize=False)
            after = text.split(_SENTINEL, 1)[1]
            for special in sorted(tok.all_special_tokens + list(tok.get_added_vocab()), key=len, reverse=True):
                if special and after.startswith(special):
                    return tok.convert_tokens_to_ids(special)
        return tok.eos_token_id

    @classmethod
    def for_env(cls, tokenizer, env, max_prompt_tokens: int | None = None) -> "PromptBuilder":
        """The prompt builder of an ``env`` config (``textrl.config.EnvConfig``)."""
        return cls(tokenizer, max_prompt_tokens or env.max_prompt_tokens, env.list_commands, env.goal_last,
                   env.keep_answers)

    def encode_command(self, command: str) -> list[int]:
        """Command token ids without the end token (the trie adds it)."""
        return self._encode(self._command_prefix + command)

    MEMO_ENTRIES = 1 << 16  # a long-lived builder (the module's, for probes) forgets past this

    def _encode(self, text: str) -> list[int]:
        """``tokenizer.encode`` of one piece of prompt text, remembered: an episode's earlier turns
        are the same pieces at every later turn (``build`` tokenizes the prompt piece by piece), so
        each is tokenized once per episode instead of once per turn, and a turn's tokenizing costs
        its new text only, however long the history."""
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= self.MEMO_ENTRIES:
                self._encoded.clear()
            ids = self._encoded[text] = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return list(ids)

    def trie(self, obs: Observation) -> CommandTrie:
        """The trie of an observation's admissible commands, tokenized as they follow this prompt.
        A command longer than ``COMMAND_ROOM`` tokens (with its end token) raises PromptTooLongError:
        the prompt budget leaves that room for it within the model's positions
        (``textrl.config.fit_to_positions``)."""
        trie = CommandTrie(obs.admissible_commands, self.encode_command, self.end_id)
        command, ids = max(trie.commands.items(), key=lambda item: len(item[1]))
        if len(ids) > COMMAND_ROOM:
            raise PromptTooLongError(f"the command {command!r} is {len(ids)} tokens with its end token, over the "
                                     f"{COMMAND_ROOM} the prompt budget leaves for a command (COMMAND_ROOM)")
        return trie

    def _pieces(self, obs: Observation, history: Sequence[Turn]) -> list[str]:
        """Prompt text split around the past commands: len(history) + 1 pieces."""
        system = SYSTEM.format(objective=obs.objective)
        if self.chat:
            messages = [{"role": "system", "content": system}]
            for turn in history:
                messages.append({"role": "user", "content": observation_text(turn.observation, self.list_commands, self.goal_last)})
                messages.append({"role": "assistant", "content": _SENTINEL})
            messages.append({"role": "user", "content": observation_text(obs, self.list_commands, self.goal_last)})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            pieces = text.split(_SENTINEL)
            end = self.tokenizer.convert_ids_to_tokens(self.end_id)
            # The template writes its own end-of-turn token after each command; ours is in the ids.
            return [pieces[0]] + [p[len(end):] if p.startswith(end) else p for p in pieces[1:]]
        text = system + "\n\n"
        pieces = []
        for turn in history:
            pieces.append(text + observation_text(turn.observation, self.list_commands, self.goal_last) + "\n>")
            text = "\n\n"
        pieces.append(text + observation_text(obs, self.list_commands, self.goal_last) + "\n>")
        return pieces

    def build(self, obs: Observation, history: Sequence[Turn]) -> list[int]:
        history = list(history)
        while True:
            pieces = self._pieces(obs, history)
            ids = self._encode(pieces[0])
            for turn, piece in zip(history, pieces[1:]):
                ids += self.encode_command(turn.command) + [self.end_id]
                ids += self._encode(piece)
            if len(ids) <= self.max_prompt_tokens:
                return ids
            if not history:
                raise PromptTooLongError(
                    f"the prompt for the current observation alone is {len(ids)} tokens, over "
                    f"max_prompt_tokens={self.max_prompt_tokens}; raise env.max_prompt_tokens")
            drop_oldest(history, self.DROP_BLOCK, self.keep_answers)  # oldest turns first

"""Prefix tree of tokenized admissible commands.

Every command is stored as its token ids followed by an end token, so a command that is a prefix
of another ("take key" / "take key from box") ends at a fork between the end token and the rest.
A node with a single child is not a choice: the decoder follows such chains without sampling
("auto-advance"), so only tokens at forks are decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class TrieNode:
    __slots__ = ("children", "command")

    def __init__(self):
        self.children: dict[int, TrieNode] = {}
        self.command: str | None = None  # set on the node reached through the end token

    @property
    def is_fork(self) -> bool:
        return len(self.children) > 1


class CommandTrie:
    def __init__(self, commands: Iterable[str], encode: Callable[[str], list[int]], end_id: int):
        self.root = TrieNode()
        self.end_id = end_id
        self.commands: dict[str, list[int]] = {}
        for command in dict.fromkeys(commands):  # de-duplicated, order kept
            ids = list(encode(command)) + [end_id]
            if end_id in ids[:-1]:
                raise ValueError(f"command {command!r} tokenizes to the end token {end_id}")
            node = self.root
            for token in ids:
                node = node.children.setdefault(token, TrieNode())
            if node.command is not None:
                raise ValueError(f"commands {node.command!r} and {command!r} have the same tokens")
            node.command = command
            self.commands[command] = ids
        if not self.commands:
            raise ValueError("a command trie needs at least one command")

    def advance(self, node: TrieNode) -> tuple[list[int], TrieNode]:
        """Follow single-child links from ``node``: the forced tokens and the node where they stop.

        Stops at a fork, or right before the end token of a finished command (the end token is
        returned among the forced tokens and the returned node is the leaf).
        """
        forced = []
        while len(node.children) == 1:
            token, node = next(iter(node.children.items()))
            forced.append(token)
            if token == self.end_id:
                break
        return forced, node

    def decisions(self, command: str) -> list[int]:
        """Indices into ``self.commands[command]`` of the tokens chosen at forks."""
        node, out = self.root, []
        for i, token in enumerate(self.commands[command]):
            if node.is_fork:
                out.append(i)
            node = node.children[token]
        return out

import pytest

from textrl.policy.trie import CommandTrie

END = 0


def char_trie(commands):
    """Each character is a token: forks are easy to read off the strings."""
    return CommandTrie(commands, lambda s: [ord(c) for c in s], END)


def test_single_child_chains_are_auto_advanced():
    trie = char_trie(["go north", "go south", "look"])
    forced, node = trie.advance(trie.root)
    assert forced == [] and node.is_fork and set(node.children) == {ord("g"), ord("l")}
    forced, node = trie.advance(node.children[ord("g")])
    assert forced == [ord(c) for c in "o "] and set(node.children) == {ord("n"), ord("s")}
    forced, leaf = trie.advance(node.children[ord("n")])
    assert forced == [ord(c) for c in "orth"] + [END] and leaf.command == "go north"


def test_only_forks_are_decisions():
    trie = char_trie(["go north", "go south", "look"])
    assert trie.decisions("go north") == [0, 3]
    assert trie.decisions("look") == [0]
    assert char_trie(["look"]).decisions("look") == []  # one command: nothing to decide


def test_a_command_that_prefixes_another_ends_at_a_fork_with_the_end_token():
    trie = char_trie(["take key", "take key from box"])
    ids = trie.commands["take key"]
    assert ids[-1] == END
    assert trie.decisions("take key") == [len("take key")]  # the end token is the choice
    assert trie.decisions("take key from box") == [len("take key")]


def test_with_a_real_tokenizer(prompts):
    commands = ["examine mug", "examine bureau", "close bureau", "go north", "look"]
    trie = CommandTrie(commands, prompts.encode_command, prompts.end_id)
    for command in commands:
        ids = trie.commands[command]
        assert prompts.tokenizer.decode(ids[:-1]) == command and ids[-1] == prompts.end_id
        assert trie.decisions(command)[0] == 0  # the verb is always a choice here


def test_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        char_trie([])
    with pytest.raises(ValueError, match="end token"):
        CommandTrie(["a"], lambda s: [END, 5], END)

"""Shared fixtures: real TextWorld games from the textrl cache and the real tiny model.

Games and the converted SmolLM2 tokenizer live in the normal textrl cache ($TEXTRL_CACHE or
~/.cache/textrl), so a second run of the suite reuses them; tests that exercise the cache itself
use their own temporary directories.
"""

from __future__ import annotations

import pytest
import torch

from textrl.config import load_model_config
from textrl.games.pool import GamePool
from textrl.games.prompt import PromptBuilder
from textrl.policy.model import build_policy


@pytest.fixture(scope="session")
def easy_pool() -> GamePool:
    return GamePool("easy")


@pytest.fixture(scope="session")
def easy_games(easy_pool):
    """24 held-out easy games."""
    return easy_pool.games("eval", 24)


@pytest.fixture(scope="session")
def tiny():
    """(policy, tokenizer) of the randomly initialised 2-layer model, in eval mode."""
    torch.manual_seed(0)
    policy, tokenizer = build_policy(load_model_config("tiny"))
    policy.eval()
    return policy, tokenizer


@pytest.fixture(scope="session")
def prompts(tiny):
    return PromptBuilder(tiny[1], max_prompt_tokens=4096)

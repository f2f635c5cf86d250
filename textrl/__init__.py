"""textrl: token-level PPO for small language models playing TextWorld games."""

__version__ = "0.1.0"

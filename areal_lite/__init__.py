"""areal-lite: asynchronous reinforcement learning for language models, readable end to end."""

__version__ = "0.1.0"

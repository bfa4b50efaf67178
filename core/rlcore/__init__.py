"""rlcore: reinforcement-learning post-training for LLMs as a minimal core plus plugins."""
__version__ = "0.1.0"

"""rlcore algorithm plugin: PPO with a critic and GAE."""

"""rlcore model plugin for DeepSeek-V3 and Moonlight."""

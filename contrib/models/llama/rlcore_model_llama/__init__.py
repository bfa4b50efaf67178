"""rlcore model plugin for Llama 3.x."""

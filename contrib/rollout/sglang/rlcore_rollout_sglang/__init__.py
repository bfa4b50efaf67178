"""rlcore rollout plugin: SGLang. (Imported at every interpreter start through rlcore_rollout_sglang.pth: keep it
free of imports.)"""

"""`rlcore export <checkpoint> <out dir>`: an HF checkpoint (config.json, model.safetensors, tokenizer) from a run
checkpoint, in this process at TP1 whatever layout saved it, with no rollout engine; loadable by transformers and
vLLM. The model is rebuilt from the checkpoint's own config and model family; its weights come from the checkpoint
only (the optimizer state is not read)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

from rlcore.errors import ConfigError


def export_checkpoint(path: str, out: str, plugin_names: list[str] | None = None) -> str:
    from rlcore.checkpoint import STATE
    from rlcore.config import config_from_dict
    from rlcore.config.schema import ParallelConfig
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.checkpoint import load_model
    from rlcore.plugins import load_plugins

    state_file = os.path.join(path, STATE)
    if not os.path.isfile(state_file):
        raise ConfigError(f"{path!r} is not a complete rlcore checkpoint (no {STATE}): give a <run dir>/checkpoints/"
                          f"step_<N> directory")
    with open(state_file) as f:
        state = json.load(f)
    cfg = config_from_dict(state["config"])
    registry = load_plugins(plugin_names).registry
    actor_cfg = dataclasses.replace(cfg.actor, parallel=ParallelConfig(), offload=type(cfg.actor.offload)())
    actor = MegatronActor(registry.get("models", state["model"]["family"]), state["model"]["hf_config"], actor_cfg,
                          registry.get("optimizers", cfg.actor.optim.name))
    load_model(actor, os.path.join(path, "actor", "model"), with_optimizer=False)
    actor.save_hf(out)
    tokenizer = os.path.join(path, "tokenizer")
    for name in os.listdir(tokenizer) if os.path.isdir(tokenizer) else []:
        shutil.copy(os.path.join(tokenizer, name), os.path.join(out, name))
    return out

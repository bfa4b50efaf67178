"""A reward model in `rlcore run --dry-run`: ``reward_model.path``'s config.json, or ``reward_model.hf_config`` (a path
or a bundled name, as model.hf_config), checked and counted as the actor is (``rlcore.sizing``) in its own layout and
world (``reward_model_world``): its parameters only (it runs forward only: no gradients, no optimizer state), the
score head [1, hidden] in place of the vocabulary projection."""
from __future__ import annotations

import os

from rlcore.config.schema import Config
from rlcore.errors import ConfigError
from rlcore.sizing import GIB, config_file, read_config, stage_params


def read_reward_model_config(cfg: Config) -> dict | None:
    """The reward model's config.json: reward_model.path's, else reward_model.hf_config (a path or a bundled name,
    as model.hf_config); None without a reward model."""
    rm = cfg.reward_model
    if rm.kind == "generative" or not (rm.path or rm.hf_config):     # a judge runs on an engine, not Megatron
        return None
    path = os.path.join(os.path.expanduser(rm.path), "config.json") if rm.path else config_file(rm.hf_config)
    return read_config(path, "reward_model.path / reward_model.hf_config")


def reward_model_spec(cfg: Config, models: dict, hf: dict):
    """The reward model's family (``rlcore.megatron.reward_model.family_of``: among ``models``, the registry's) once
    its config passes what the run checks before any worker starts (with reward_model.path, ``check_reward_model``,
    its files' score head included; with reward_model.hf_config, the config's part of it) and its parallel sizes fit
    its world as the config loader checks them; a ConfigError in one line naming the key otherwise."""
    from rlcore.config import reward_model_world
    from rlcore.config.checks import check_layout
    from rlcore.megatron.reward_model import check_classifier_config, check_reward_model

    rm = cfg.reward_model
    key, given = ("reward_model.path", rm.path) if rm.path else ("reward_model.hf_config", rm.hf_config)
    try:        # a config only (a plan for another machine) has no weights to look into
        spec = (check_reward_model(models, hf, os.path.expanduser(rm.path), rm.dtype) if rm.path
                else check_classifier_config(models, hf, rm.dtype))
    except ValueError as e:
        raise ConfigError(f"{key} {given!r}: {e}") from None
    world_key = ("reward_model.world_size" if rm.world_size else "trainer.world_size"
                 if cfg.trainer.mode == "colocated" else "rollout.world_size")
    check_layout("reward_model", rm, reward_model_world(cfg), world_key)
    return spec


def reward_model_estimate(c, hf: dict, cfg: Config) -> dict:
    """The reward model's bytes per device (busiest stage) in its own layout: its parameters only, as it runs forward
    only (no gradients, no optimizer state); the embedding on the first stage, the final norm and the score head
    [1, hidden] on the last. With ``reward_model.offload.params`` they are on the device only during its passes and
    on the host between them (``cpu_per_node``)."""
    from rlcore.config import reward_model_world

    rm, world = cfg.reward_model, reward_model_world(cfg)
    p = rm.parallel
    stages = stage_params(c, hf["vocab_size"], False, p.pp, p.last_stage_layers, tp=p.tp, ep=p.ep, output_rows=1)
    params = max(s.dense / p.tp + s.experts / p.ep for s in stages) * (2 if rm.dtype == "bfloat16" else 4)
    return dict(total_params=sum(s.dense + s.experts for s in stages), params=params, world=world,
                dp=world // (p.tp * p.pp * p.cp), expert_dp=world // (p.ep * p.pp),
                cpu_per_node=params * min(cfg.trainer.devices_per_node, world) if rm.offload.params else 0.0)


def reward_model_lines(cfg: Config, spec, config, m: dict, actor_per_device: float) -> list[str]:
    rm, p = cfg.reward_model, cfg.reward_model.parallel
    colocated = cfg.trainer.mode == "colocated"
    beside, theirs = ("the actor", cfg.trainer.world_size) if colocated else ("the rollout workers",
                                                                             cfg.rollout.world_size)
    where = (f"its own {m['world']} processes, one per device of {beside}'s {theirs} ({cfg.trainer.mode}: the same "
             f"devices)" if m["world"] == theirs else
             f"its own {m['world']} processes (reward_model.world_size), one per device")
    resident = (f"on the device only while it scores (reward_model.offload.params=true); between its passes on the "
                f"host, {m['cpu_per_node'] / GIB:.0f} GiB per node" if rm.offload.params else
                "kept on the device between its passes (reward_model.offload.params=false)"
                + (f": with the actor's, {(actor_per_device + m['params']) / GIB:.1f} GiB per device"
                   if colocated and m["world"] == theirs else ""))
    return [
        f"reward     {spec.name} sequence classifier ({'reward_model.path' if rm.path else 'reward_model.hf_config'}"
        f" {rm.path or rm.hf_config}): {m['total_params'] / 1e9:.1f}B parameters, {config.num_layers} layers"
        + (f", {config.num_moe_experts} experts" if config.num_moe_experts else "")
        + f", score head [1, {config.hidden_size}] in place of the vocabulary projection; forward only",
        f"           world {m['world']} = tp {p.tp} x pp {p.pp} x cp {p.cp} x dp {m['dp']}"
        + (f"; ep {p.ep} (expert dp {m['expert_dp']})" if config.num_moe_experts else "") + "; "
        + (f"last stage {p.last_stage_layers} layers" if p.last_stage_layers else "layers split evenly")
        + f"; {where}",
        f"           per device params {m['params'] / GIB:.1f} GiB ({rm.dtype}, busiest stage; no gradients, no "
        f"optimizer state): {resident}",
    ]

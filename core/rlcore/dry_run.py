"""`rlcore run --dry-run`: the report of a layout checked against the model (and a reward model) and its memory per
device and per node (``rlcore.sizing``, ``rlcore.reward_model_sizing``), without any device."""
from __future__ import annotations

import os
import sys

from rlcore.config.schema import Config
from rlcore.errors import ConfigError
from rlcore.megatron.vision import tower_parameters
from rlcore.reward_model_sizing import (read_reward_model_config, reward_model_estimate, reward_model_lines,
                                        reward_model_spec)
from rlcore.sizing import GIB, estimate, layout_problems, read_model_config, routes_memory


def dry_run(cfg: Config, spec, reference: bool = False, models: dict | None = None) -> tuple[list[str], str]:
    """(problems, report). No problems = the layout fits this model (model state only; see the module docstring).
    ``reference``: the algorithm keeps a frozen reference policy (``estimate``). ``models``: the registry's model
    families, among which a reward model's (reward_model.path / hf_config) is found; it is checked and counted too."""
    from rlcore.megatron.model import check_model_config, transformer_config

    hf, p = read_model_config(cfg), cfg.actor.parallel
    try:        # the family handles this architecture and maps every key, as the run would check
        check_model_config(spec, hf, cfg.actor.dtype)
    except ValueError as e:
        raise ConfigError(f"model config {cfg.model.path or cfg.model.hf_config!r}: {e}") from e
    problems = layout_problems(cfg, spec, hf)
    rm_hf = read_reward_model_config(cfg) if models is not None else None
    if models is not None and rm_hf is not None:
        rm_spec = reward_model_spec(cfg, models, rm_hf)
        problems += layout_problems(cfg, rm_spec, rm_hf, "reward_model")
    if problems:
        return problems, ""
    config = transformer_config(spec, hf, cfg.actor.dtype)          # the model's sizes, unsplit
    tower = tower_parameters(spec.vision, hf) if spec.vision is not None else 0
    projector = tower_parameters(spec.vision, hf, "projector") if spec.vision is not None else 0
    m = estimate(config, hf, cfg, reference, tower, projector)
    d = m["per_device"]
    lines = [
        f"model      {spec.name}: {m['total_params'] / 1e9:.1f}B parameters, {config.num_layers} layers"
        + (f", {config.num_moe_experts} experts" if config.num_moe_experts else ""),
        *([f"vision     {tower / 1e9:.2f}B parameters of its vision tower on the first pipeline stage, whole on "
           f"each of its {p.tp} TP rank(s) (in the totals)"] if tower else []),
        f"layout     world {cfg.trainer.world_size} = tp {p.tp} x pp {p.pp} x cp {p.cp} x dp {m['dp']}; "
        f"ep {p.ep} (expert dp {m['expert_dp']}); "
        + (f"last stage {p.last_stage_layers} layers" if p.last_stage_layers else "layers split evenly"),
        f"per device params {d['params'] / GIB:.1f} GiB + grads {d['grads'] / GIB:.1f} GiB + optimizer "
        f"{d['optimizer'] / GIB:.1f} GiB"
        + (f" + reference {d['reference'] / GIB:.1f} GiB" if "reference" in d else "")
        + f" = {sum(d.values()) / GIB:.1f} GiB (busiest stage; activations, rollout weights and KV cache not "
        f"included)",
    ]
    if cfg.actor.lora.rank:
        lora = cfg.actor.lora
        lines.append(f"lora       rank {lora.rank} on {', '.join(lora.target_modules)}: "
                     f"{m['adapters_per_device'] / 1e6:.1f}M adapter parameters per device, the only ones with "
                     f"gradients and optimizer state (the base frozen); the reference policy is the model with "
                     f"its adapters off (no copy)")
    if cfg.actor.freeze:
        sizes = {"vision_tower": tower - projector, "projector": projector, "language_model": m["total_params"] - tower}
        lines.append(f"frozen     {', '.join(f'{part} ({sizes[part] / 1e9:.2f}B)' for part in cfg.actor.freeze)}: "
                     f"parameters as loaded, without gradients or optimizer state (actor.freeze)")
    if reference and not cfg.actor.lora.rank:
        lines.append(f"reference  {m['reference'] / GIB:.1f} GiB per device, the frozen policy of the KL term: "
                     + ("on the host between its passes (in CPU/node below)" if m["reference_on_host"] else
                        "kept on the device (in the total above)")
                     + f"; actor.offload.reference={cfg.actor.offload.reference_on_host()}")
    if cfg.actor.moe.routing_replay == "rollout" and config.num_moe_experts:
        lines.append(routes_line(cfg, routes_memory(config, hf, cfg, m["dp"]), m["dp"]))
    lines += [
        f"CPU/node   {m['cpu_per_node_training'] / GIB:.0f} GiB while training (optimizer offload fraction "
        f"{cfg.actor.optim.offload_fraction:g}), {m['cpu_per_node_rollout'] / GIB:.0f} GiB while the rollout "
        f"runs (actor.offload: params={cfg.actor.offload.params}, grads={cfg.actor.offload.grads}, "
        f"optimizer={cfg.actor.offload.optimizer}); {min(cfg.trainer.devices_per_node, cfg.trainer.world_size)} "
        f"devices per node",
    ]
    if cfg.trainer.mode == "async":
        r = cfg.rollout
        lines.append(f"rollout    async: {r.world_size // r.tp} rollout worker(s) of their own, one engine each at "
                     f"tp {r.tp} ({m['total_params'] * 2 / GIB / r.tp:.1f} GiB of weights in 16-bit per process) "
                     f"and its KV cache; max_staleness "
                     f"{r.max_staleness}, partial {r.partial}, weights pushed every {r.sync_every} step(s) from the "
                     f"trainer's rank 0 in buckets of {r.sync_bucket_mb:g} MB; old policy: "
                     f"actor.old_logprobs={cfg.actor.old_logprobs}")
    if rm_hf is not None:
        rm_config = transformer_config(rm_spec, rm_hf, cfg.reward_model.dtype)
        lines += reward_model_lines(cfg, rm_spec, rm_config, reward_model_estimate(rm_config, rm_hf, cfg),
                                     sum(d.values()))
    return [], "\n".join(lines)


def size(n: float) -> str:
    """Bytes in the largest binary unit that keeps them >= 1 (up to GiB)."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def routes_line(cfg: Config, r: dict, dp: int) -> str:
    """The routes routing replay carries (``rlcore.sizing.routes_memory``): host memory, with the batch."""
    line = (f"routes     actor.moe.routing_replay=rollout: {r['per_token']} B a token ({r['layers']} MoE layers x "
            f"top-{r['top_k']} expert ids, int16) in host memory, carried with the batch (on the device one "
            f"micro-batch's at a time, small): a sample {size(r['sample_response'])} at rollout.max_response_len = "
            f"{cfg.rollout.max_response_len} tokens (its prompt on top), up to {size(r['sample_context'])} at the "
            f"model's context of {r['context']}; a step's {r['samples']} samples ({cfg.trainer.prompts_per_step} "
            f"prompts x {cfg.rollout.n}, padded to the longest) {size(r['batch_response'])}, up to "
            f"{size(r['batch_context'])}; a data-parallel rank's share (dp {dp}: {r['rank_samples']} samples) "
            f"{size(r['rank_response'])}, up to {size(r['rank_context'])}")
    if cfg.trainer.world_size > 1:
        line += (f"; a node's object store holds its workers' shares once, read in place ({r['node_shares']} distinct "
                 f"share(s) among its {r['devices']} workers): {size(r['node_response'])}, up to "
                 f"{size(r['node_context'])} per node")
    return line


def command(cfg: Config, plugins) -> int:
    """``rlcore run --dry-run``: what the run would check before any worker starts, then the report; the exit
    code (2: the layout does not fit)."""
    from rlcore.config import bind_plugin_section
    from rlcore.preflight import (check_context, check_converted_dtype, check_freeze, check_optimizers,
                                  check_rollout_backend)
    from rlcore.run import check_agent
    from rlcore.sizing import read_model_config

    reg = plugins.registry
    algorithm = reg.get("algorithms", cfg.algorithm["name"])
    algo_cfg = bind_plugin_section("algorithm", dict(cfg.algorithm), algorithm.config_cls)
    check_agent(cfg, reg)
    check_optimizers(cfg, reg, algorithm.needs_critic(algo_cfg))
    hf_config = read_model_config(cfg)
    if cfg.model.path:
        check_converted_dtype(cfg, os.path.expanduser(cfg.model.path))
    check_rollout_backend(cfg, reg, hf_config, here=False)
    check_freeze(cfg, reg.get("models", cfg.model.family))
    check_context(cfg, hf_config)
    problems, report = dry_run(cfg, reg.get("models", cfg.model.family), algorithm.needs_reference(algo_cfg),
                               reg.models)
    if problems:
        print("rlcore: error: the layout does not fit the model:\n" + "\n".join(f"  - {p}" for p in problems),
              file=sys.stderr)
        return 2
    print(report)
    return 0

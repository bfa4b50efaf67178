"""What plugins check in a run's settings before any worker starts: at the start of a run and on ``--dry-run``, by
the same functions, so a dry run refuses what the run would."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcore.config import Config
from rlcore.errors import ConfigError
from rlcore.registry import Registry

if TYPE_CHECKING:
    from rlcore.specs import ModelSpec, Task


def check_optimizers(cfg: Config, registry: Registry, needs_critic: bool) -> None:
    """Each trained model's optimizer plugin checks its section (``offload_fraction``: hybrid_adam's)."""
    for section, model in [("actor", cfg.actor)] + ([("critic", cfg.critic)] if needs_critic else []):
        optimizer = registry.get("optimizers", model.optim.name)
        if optimizer.check:
            optimizer.check(model.optim, f"{section}.optim")


def check_rollout_backend(cfg: Config, registry: Registry, hf_config: dict[str, Any], here: bool = True) -> None:
    """The rollout backend says whether it can serve this model (architecture, sizes) with these settings; ``here``:
    on this machine (false for a dry run, which plans for others)."""
    backend = registry.get("rollout_backends", cfg.rollout.backend)
    if cfg.rollout.lora == "adapters":
        check_adapter_sync(cfg, backend.lora_adapters, hf_config)
    if registry.get("models", cfg.model.family).vision is not None:
        check_images(cfg, backend.images)
    if cfg.actor.moe.routing_replay != "off":
        check_routing_replay(cfg, registry.get("models", cfg.model.family), hf_config, backend.routed_experts, here)
    if backend.check:
        backend.check(hf_config, cfg.rollout, here)


def check_freeze(cfg: Config, spec: ModelSpec) -> None:
    """``actor.freeze`` names parts this model has, leaves one to train, and leaves every pipeline stage something."""
    from rlcore.model_parts import PARTS, VISION_PARTS

    frozen, family = cfg.actor.freeze, cfg.model.family
    named = [part for part in frozen if part in VISION_PARTS]
    if named and spec.vision is None:
        raise ConfigError(f"actor.freeze = {frozen} names {', '.join(named)}, which model.family = {family!r} "
                          f"lacks (it has no vision tower); remove {', '.join(named)}")
    if set(PARTS if spec.vision is not None else ["language_model"]) <= set(frozen):
        raise ConfigError(f"actor.freeze = {frozen} freezes every part of model.family = {family!r}: nothing would "
                          f"train; leave at least one part out")
    if "language_model" in frozen and cfg.actor.parallel.pp > 1:
        raise ConfigError(f"actor.freeze = {frozen} with actor.parallel.pp = {cfg.actor.parallel.pp}: the pipeline "
                          f"stages after the first hold only the language model, so they would have nothing to "
                          f"train; use actor.parallel.pp=1, or leave language_model out")


def check_images(cfg: Config, engine_takes_images: bool) -> None:
    """What a vision-language model's run needs of the rest of it."""
    if not engine_takes_images:
        raise ConfigError(f"rollout.backend = {cfg.rollout.backend!r} does not take images with its prompts, which "
                          f"model.family = {cfg.model.family!r} reads; use rollout.backend=vllm")
    if cfg.rollout.agent != "single_turn":
        raise ConfigError(f"rollout.agent = {cfg.rollout.agent!r} with the vision-language model.family = "
                          f"{cfg.model.family!r}: only single_turn gives episodes their images yet; use "
                          f"rollout.agent=single_turn")
    if cfg.actor.parallel.cp > 1:
        raise ConfigError(f"actor.parallel.cp = {cfg.actor.parallel.cp} with the vision-language model.family = "
                          f"{cfg.model.family!r}: its M-RoPE positions are not split over context-parallel ranks "
                          f"yet; use cp=1")


def check_routing_replay(cfg: Config, spec: ModelSpec, hf_config: dict[str, Any], engine_devices: tuple[str, ...],
                         here: bool) -> None:
    """``actor.moe.routing_replay=rollout`` needs a model with MoE layers and an engine that returns its routes
    (on this machine's device type, when ``here``)."""
    import torch

    from rlcore.megatron.model import transformer_config

    key, backend = "actor.moe.routing_replay", cfg.rollout.backend
    if not transformer_config(spec, hf_config).num_moe_experts:
        raise ConfigError(f"{key} = {cfg.actor.moe.routing_replay!r} with model.family = {cfg.model.family!r}: the "
                          f"model has no MoE layers to replay routes in; use {key}=off")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not engine_devices or (here and device not in engine_devices):
        where = f" on {device} (it does on {', '.join(engine_devices)})" if engine_devices else ""
        raise ConfigError(f"{key} = 'rollout' with rollout.backend = {backend!r}: that engine cannot return the "
                          f"experts it routed each token to{where}; use {key}=off, or a backend that can (sglang, hf)")
    if cfg.actor.recompute == "full" and cfg.actor.parallel.pp > 1:
        raise ConfigError(f"{key} = 'rollout' with actor.recompute = 'full' at actor.parallel.pp = "
                          f"{cfg.actor.parallel.pp}: the recomputed forward of an earlier micro-batch would replay a "
                          f"later one's routes; use actor.recompute=selective or none")


def check_adapter_sync(cfg: Config, serves_adapters: bool, hf_config: dict[str, Any]) -> None:
    """``rollout.lora=adapters`` needs an engine that serves LoRA adapters and that starts from the base weights."""
    if not serves_adapters:
        raise ConfigError(f"rollout.lora = 'adapters' with rollout.backend = {cfg.rollout.backend!r}: that backend "
                          f"does not serve LoRA adapters; use rollout.lora=merged (the adapted weights sent merged) "
                          f"or a backend that does (vllm)")
    if hf_config.get("quantization_config"):
        raise ConfigError("rollout.lora = 'adapters' with a quantized checkpoint (config.json's quantization_config): "
                          "the engine cannot start from its files (rlcore dequantizes them and pushes the weights), "
                          "so it has no base weights for the adapters; use rollout.lora=merged")


def check_converted_dtype(cfg: Config, model_path: str) -> None:
    """A checkpoint ``rlcore convert`` wrote holds its weights at the dtype it was converted at: an actor at another
    would train on them rounded (or widened from rounded ones), so the two must agree."""
    from rlcore.converted import converted_dtype

    converted = converted_dtype(model_path)
    if converted is not None and converted != cfg.actor.dtype:
        raise ConfigError(f"model.path {model_path} was converted at {converted} (rlcore convert --dtype); "
                          f"actor.dtype is {cfg.actor.dtype}: set actor.dtype={converted} or convert again with "
                          f"--dtype {cfg.actor.dtype}")


def check_layout(cfg: Config, spec: "ModelSpec", hf_config: dict[str, Any]) -> None:
    """The actor's parallel layout against the model, by the dry run's own function (``rlcore.sizing``), in one line:
    Megatron would otherwise refuse it inside a worker, with a traceback."""
    from rlcore.sizing import layout_problems

    problems = layout_problems(cfg, spec, hf_config)
    if problems:
        raise ConfigError(f"the layout does not fit the model: {'; '.join(problems)} (rlcore run --dry-run checks a "
                          f"layout without starting anything)")


def check_context(cfg: Config, hf_config: dict[str, Any], task: "Task | None" = None) -> None:
    """A prompt and ``rollout.max_response_len`` tokens must fit the model's context: the engines are started with
    that length, so a prompt that leaves too little room would otherwise fail only once they run. ``task``: one
    whose prompts are rendered (``Task.longest_prompt``); without it (a dry run) only the response is checked."""
    context, response = hf_config["max_position_embeddings"], cfg.rollout.max_response_len
    if response >= context:
        raise ConfigError(f"rollout.max_response_len = {response} leaves no room for a prompt in the model's context "
                          f"of {context} tokens (max_position_embeddings): set rollout.max_response_len below "
                          f"{context}, minus the longest prompt")
    longest = task.longest_prompt() if task is not None else None
    if longest is not None and longest[0] + response > context:
        tokens, cap = longest
        leave_out = f", or {cap}={context - response} to leave the longer prompts out" if cap else ""
        raise ConfigError(f"the longest prompt has {tokens} tokens: with rollout.max_response_len = {response} that "
                          f"is {tokens + response}, more than the model's context of {context} tokens "
                          f"(max_position_embeddings): set rollout.max_response_len={context - tokens}{leave_out}")

"""`rlcore run --dry-run`: check a parallel layout against a model and estimate its memory, without any device.

Sizes come from the model's HF config (``model.path``'s config.json, or ``model.hf_config``: a path or the name of a
config bundled in ``configs/models``), mapped through the model plugin to a Megatron TransformerConfig with
the run's parallel sizes, so Megatron's own validation runs too. Parameters are counted from that config: MLA or
grouped-query attention, dense and MoE layers (routed + shared experts), embeddings and output layer.

Memory per device is for model state only — parameters, gradients (fp32 buffers, as the actor's DDP keeps them) and
Adam's state under the distributed optimizer (fp32 master copy when parameters are bf16, plus two moments; with
``hybrid_adam``, part of it on the host: ``optimizer_bytes``) and, where the algorithm keeps one, the frozen
reference policy's copy of the parameters (on the host with ``actor.offload.reference``) — on the busiest pipeline
stage. Activations, the rollout engine's weights and KV cache come on top.

A reward model (``reward_model.path``'s config.json, or ``reward_model.hf_config`` as above) is checked and counted
the same way in its own layout and world (``reward_model_world``): its parameters only (it runs forward only: no
gradients, no optimizer state), the score head [1, hidden] in place of the vocabulary projection.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from importlib import resources

from rlcore.config.schema import Config
from rlcore.errors import ConfigError
from rlcore.lora.sizing import adapter_params, expert_adapter_params, lora_problems

GIB = 1 << 30


def _config_file(name: str) -> str:
    """A config.json path, or the name of one bundled in configs/models."""
    bundled = resources.files("rlcore.presets") / "models" / f"{name}.json"
    return str(bundled) if bundled.is_file() else os.path.expanduser(name)


def read_model_config(cfg: Config) -> dict:
    if cfg.model.path:
        path = os.path.join(os.path.expanduser(cfg.model.path), "config.json")
    elif cfg.model.hf_config:
        path = _config_file(cfg.model.hf_config)
    else:
        raise ConfigError("--dry-run needs the model's sizes: set model.path (a checkpoint) or model.hf_config (a "
                          "config.json path, or a bundled name such as deepseek-v3)")
    return _read_config(path, "model.path / model.hf_config")


def read_reward_model_config(cfg: Config) -> dict | None:
    """The reward model's config.json: reward_model.path's, else reward_model.hf_config (a path or a bundled name,
    as model.hf_config); None without a reward model."""
    rm = cfg.reward_model
    if rm.kind == "generative" or not (rm.path or rm.hf_config):     # a judge runs on an engine, not Megatron
        return None
    path = os.path.join(os.path.expanduser(rm.path), "config.json") if rm.path else _config_file(rm.hf_config)
    return _read_config(path, "reward_model.path / reward_model.hf_config")


def _read_config(path: str, keys: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"model config {path!r} does not exist (from {keys})")
    from rlcore.megatron.model import read_hf_config
    from rlcore.quantization import checkpoint_quantization

    hf = read_hf_config(path)
    try:               # the run would refuse it: so does the dry run
        checkpoint_quantization(hf)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from e
    return hf


def layer_problems(num_layers: int, pp: int, last_stage_layers: int, section: str = "actor") -> list[str]:
    """``section``: the model whose ``parallel`` keys these are (actor, reward_model)."""
    if pp == 1:
        return [f"{section}.parallel.last_stage_layers needs {section}.parallel.pp > 1"] if last_stage_layers else []
    if not last_stage_layers:
        return [] if num_layers % pp == 0 else [
            f"{num_layers} layers do not split evenly over {section}.parallel.pp = {pp} stages: choose pp dividing "
            f"{num_layers}, or set {section}.parallel.last_stage_layers"]
    rest = num_layers - last_stage_layers
    if last_stage_layers >= num_layers or rest % (pp - 1):
        return [f"{section}.parallel.last_stage_layers = {last_stage_layers} leaves {rest} of {num_layers} layers "
                f"for {pp - 1} stages, which does not divide evenly"]
    return []


def divisibility_problems(config, cfg: Config, section: str = "actor") -> list[str]:
    """What each parallel size of ``section`` (actor, reward_model) splits must divide evenly (Megatron asserts some
    of these only at build time)."""
    p = getattr(cfg, section).parallel
    problems = layer_problems(config.num_layers, p.pp, p.last_stage_layers, section)
    splits = [("attention heads", config.num_attention_heads, "tp", p.tp),
              ("FFN width", config.ffn_hidden_size, "tp", p.tp)]
    if not getattr(config, "multi_latent_attention", False):
        splits.append(("query groups (KV heads)", config.num_query_groups, "tp", p.tp))
    if config.num_moe_experts:
        splits.append(("experts", config.num_moe_experts, "ep", p.ep))
    problems += [f"{what} = {n} is not divisible by {section}.parallel.{key} = {size}"
                 for what, n, key, size in splits if n % size]
    if config.num_moe_experts and p.tp > 1 and not p.sp:    # megatron-core refuses it at the first update
        problems.append(f"a MoE model at {section}.parallel.tp = {p.tp} needs {section}.parallel.sp=true "
                        "(megatron-core trains MoE layers with tensor parallelism only with sequence parallelism)")
    for key in dict.fromkeys(key for _, n, key, size in splits if n % size):      # what to choose instead
        common = math.gcd(*(n for _, n, k, _ in splits if k == key))
        problems.append(f"{section}.parallel.{key} values that divide every size it splits: "
                        f"{', '.join(str(d) for d in range(1, common + 1) if common % d == 0)}")
    return problems


def _attention_params(c) -> int:
    h, n = c.hidden_size, c.num_attention_heads
    if getattr(c, "multi_latent_attention", False):
        qk = c.qk_head_dim + c.qk_pos_emb_head_dim
        query = (h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * qk) if c.q_lora_rank else h * n * qk
        kv = h * (c.kv_lora_rank + c.qk_pos_emb_head_dim) + c.kv_lora_rank + c.kv_lora_rank * n * (c.qk_head_dim
                                                                                                    + c.v_head_dim)
        return query + kv + n * c.v_head_dim * h
    d = c.kv_channels
    norms = 2 * d if c.qk_layernorm else 0
    return h * (n + 2 * c.num_query_groups) * d + n * d * h + norms


def _mlp_params(h: int, ffn: int, gated: bool) -> int:
    return h * ffn * (2 if gated else 1) + ffn * h


def _moe_layers(c) -> list[bool]:
    if not c.num_moe_experts:
        return [False] * c.num_layers
    freq = c.moe_layer_freq
    return [bool(x) for x in freq] if isinstance(freq, list) else [i % freq == 0 for i in range(c.num_layers)]


def optimizer_bytes(numel: float, bf16: float, offloaded: float = 0.0) -> tuple[float, float]:
    """(device, host) bytes of Adam's state for ``numel`` elements of a rank's distributed-optimizer shard, ``bf16``
    of them bf16 parameters, ``offloaded`` of them held on the host by megatron-core's hybrid optimizer. On the
    device: two fp32 moments per element left there, and the fp32 master copy of every bf16 element, offloaded or
    not (the distributed optimizer keeps it; the hybrid one copies its host result back into it). On the host, per
    offloaded element: an fp32 copy of the parameter, its fp32 gradient and the two moments.
    tests/unit/megatron/test_hybrid_optimizer.py measures these on the optimizers the plugins build."""
    return (numel - offloaded) * 8 + bf16 * 4, offloaded * 16


def offloaded_elements(numel: float, fraction: float) -> float:
    """Elements of a shard of ``numel`` that ``offload_fraction`` puts on the host: megatron-core moves whole
    parameters, in order, until ``fraction * numel`` is reached, so the host holds up to one parameter more."""
    return numel * fraction


@dataclass
class StageParams:
    dense: int      # split over TP (approximately: norms are replicated, and small)
    experts: int    # split over EP
    adapters: float = 0.0   # LoRA parameters of one TP rank (actor.lora)
    expert_adapters: float = 0.0   # of which on routed experts (one EP rank's; their optimizer shard: / expert DP)


def stage_params(c, vocab_size: int, tied: bool, pp: int, last_stage_layers: int, lora=None,
                 tp: int = 1, ep: int = 1, output_rows: int | None = None) -> list[StageParams]:
    """Parameters of each pipeline stage: embedding on the first, final norm and output layer on the last; with
    ``lora`` (actor.lora, rank > 0) also a TP rank's adapters. ``output_rows``: the output layer's rows, the
    vocabulary by default (1: a scalar head, a reward model's score head)."""
    h, gated = c.hidden_size, c.gated_linear_unit
    per_layer = []
    lora = lora if lora is not None and lora.rank else None
    adapters = [adapter_params(c, lora.rank, lora.target_modules, moe, tp, ep) if lora else 0.0
                for moe in _moe_layers(c)]
    expert_adapters = [expert_adapter_params(c, lora.rank, lora.target_modules, moe, ep) if lora else 0.0
                       for moe in _moe_layers(c)]
    for moe in _moe_layers(c):
        dense = _attention_params(c) + 2 * h
        experts = 0
        if moe:
            dense += c.num_moe_experts * h + (c.num_moe_experts if c.moe_router_enable_expert_bias else 0)
            dense += _mlp_params(h, c.moe_shared_expert_intermediate_size or 0, gated)
            experts = c.num_moe_experts * _mlp_params(h, c.moe_ffn_hidden_size, gated)
        else:
            dense += _mlp_params(h, c.ffn_hidden_size, gated)
        per_layer.append((dense, experts))
    counts = [len(per_layer) // pp] * pp
    if last_stage_layers:
        counts = [(len(per_layer) - last_stage_layers) // (pp - 1)] * (pp - 1) + [last_stage_layers]
    stages, start = [], 0
    for s, n in enumerate(counts):
        layers = per_layer[start:start + n]
        stage_adapters = sum(adapters[start:start + n])
        stage_expert_adapters = sum(expert_adapters[start:start + n])
        start += n
        dense = sum(d for d, _ in layers) + (vocab_size * h if s == 0 else 0)
        if s == pp - 1:
            dense += h + (0 if tied and pp == 1 else (vocab_size if output_rows is None else output_rows) * h)
        stages.append(StageParams(dense, sum(e for _, e in layers), stage_adapters, stage_expert_adapters))
    return stages


def estimate(c, hf: dict, cfg: Config, reference: bool = False) -> dict:
    """Bytes of model state per device (busiest stage) and per node's CPU, with the offload settings applied;
    ``reference``: the algorithm keeps a frozen reference policy, a second copy of the parameters (with LoRA: none,
    the reference is the model with its adapters off). With LoRA, gradients and optimizer state are the adapters'
    only: Megatron DDP and the optimizer skip frozen parameters."""
    p, world = cfg.actor.parallel, cfg.trainer.world_size
    dp, expert_dp = world // (p.tp * p.pp * p.cp), world // (p.ep * p.pp)
    lora = cfg.actor.lora.rank > 0
    reference = reference and not lora
    stages = stage_params(c, hf["vocab_size"], bool(hf.get("tie_word_embeddings")), p.pp, p.last_stage_layers,
                          cfg.actor.lora, p.tp, p.ep)
    bf16 = cfg.actor.dtype == "bfloat16"
    param_bytes = 2 if bf16 else 4
    fraction = cfg.actor.optim.offload_fraction       # hybrid_adam's (the plugin refuses it for adam)

    def stage_bytes(s: StageParams) -> dict[str, float]:
        local = s.dense / p.tp + s.experts / p.ep
        shard = s.dense / p.tp / dp + s.experts / p.ep / expert_dp
        trained = local
        if lora:        # only the adapters have gradients and optimizer state (their distributed shard: / dp)
            trained = s.adapters
            shard = (s.adapters - s.expert_adapters) / dp + s.expert_adapters / expert_dp
        # a bf16 model's norms are fp32 (rlcore's torch norms): a few thousand elements a layer, counted as bf16
        device, host = optimizer_bytes(shard, shard if bf16 else 0, offloaded_elements(shard, fraction))
        return dict(params=(local + s.adapters) * param_bytes, grads=trained * 4, optimizer=device, host=host,
                    adapters=s.adapters)

    worst = max((stage_bytes(s) for s in stages), key=lambda row: row["params"] + row["grads"] + row["optimizer"])
    per_device = dict(params=worst["params"], grads=worst["grads"], optimizer=worst["optimizer"])
    off = cfg.actor.offload           # parked on the host while the rollout engine runs
    ref = worst["params"] if reference else 0.0
    ref_on_host = reference and off.reference_on_host()     # there but for its own passes
    if reference and not ref_on_host:
        per_device["reference"] = ref
    cpu = worst["host"] + (ref if ref_on_host else 0.0)
    during_rollout = cpu + sum(per_device[k] for k in ("params", "grads", "optimizer") if getattr(off, k))
    devices_per_node = min(cfg.trainer.devices_per_node, world)
    return dict(total_params=sum(s.dense + s.experts for s in stages), per_device=per_device, reference=ref,
                adapters_per_device=worst["adapters"],
                reference_on_host=ref_on_host, cpu_per_node_training=cpu * devices_per_node,
                cpu_per_node_rollout=during_rollout * devices_per_node, dp=dp, expert_dp=expert_dp,
                stages=len(stages))


def layout_problems(cfg: Config, spec, hf: dict, section: str = "actor") -> list[str]:
    """Why the actor's parallel layout (``section``: another model's, reward_model) cannot split this model (empty:
    it can): the sizes each parallel size divides, then Megatron's own checks of the layout. ``--dry-run`` and the
    run (``rlcore.preflight.check_layout``, before any worker starts) both ask this, so a run refuses exactly what a
    dry run does rather than dying in a worker."""
    from rlcore.megatron.model import transformer_config

    model = getattr(cfg, section)
    p = model.parallel
    unsplit = transformer_config(spec, hf, model.dtype)
    problems = divisibility_problems(unsplit, cfg, section) + (lora_problems(unsplit, cfg) if section == "actor"
                                                               else [])
    if problems:
        return problems
    try:
        transformer_config(spec, hf, model.dtype, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, sequence_parallel=p.sp,
                           last_stage_layers=p.last_stage_layers)
    except (ValueError, AssertionError) as e:
        return [f"Megatron refuses {'this layout' if section == 'actor' else f'{section}.parallel'} for "
                f"{spec.name}: {e}"]
    return []


def reward_model_spec(cfg: Config, models: dict, hf: dict):
    """The reward model's family (``rlcore.megatron.reward_model.family_of``: among ``models``, the registry's) once
    its config passes what the run checks before any worker starts (with reward_model.path, ``check_reward_model``,
    its files' score head included; with reward_model.hf_config, the config's part of it) and its parallel sizes fit
    its world as the config loader checks them; a ConfigError in one line naming the key otherwise."""
    from rlcore.config import reward_model_world
    from rlcore.config.loader import _check_layout
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
    _check_layout("reward_model", rm, reward_model_world(cfg), world_key)
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


def _reward_model_lines(cfg: Config, spec, config, m: dict, actor_per_device: float) -> list[str]:
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
    m = estimate(config, hf, cfg, reference)
    d = m["per_device"]
    lines = [
        f"model      {spec.name}: {m['total_params'] / 1e9:.1f}B parameters, {config.num_layers} layers"
        + (f", {config.num_moe_experts} experts" if config.num_moe_experts else ""),
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
    if reference and not cfg.actor.lora.rank:
        lines.append(f"reference  {m['reference'] / GIB:.1f} GiB per device, the frozen policy of the KL term: "
                     + ("on the host between its passes (in CPU/node below)" if m["reference_on_host"] else
                        "kept on the device (in the total above)")
                     + f"; actor.offload.reference={cfg.actor.offload.reference_on_host()}")
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
        lines += _reward_model_lines(cfg, rm_spec, rm_config, reward_model_estimate(rm_config, rm_hf, cfg),
                                     sum(d.values()))
    return [], "\n".join(lines)

"""What `rlcore run --dry-run` checks and counts: a parallel layout against a model, and its memory, without any device.

Sizes come from the model's HF config (``model.path``'s config.json, or ``model.hf_config``: a path or the name of a
config bundled in ``configs/models``), mapped through the model plugin to a Megatron TransformerConfig with
the run's parallel sizes, so Megatron's own validation runs too. Parameters are counted from that config: MLA or
grouped-query attention, dense and MoE layers (routed + shared experts), embeddings and output layer.

Memory per device is for model state only — parameters, gradients (fp32 buffers, as the actor's DDP keeps them) and
Adam's state under the distributed optimizer (fp32 master copy when parameters are bf16, plus two moments; with
``hybrid_adam``, part of it on the host: ``optimizer_bytes``) and, where the algorithm keeps one, the frozen
reference policy's copy of the parameters (on the host with ``actor.offload.reference``) — on the busiest pipeline
stage. Activations, the rollout engine's weights and KV cache come on top. With routing replay, the routed experts
the batch carries in host memory are counted apart (``routes_memory``).

The report itself is ``rlcore.dry_run``'s; a reward model's sizes are ``rlcore.reward_model_sizing``'s.
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


def config_file(name: str) -> str:
    """A config.json path, or the name of one bundled in configs/models."""
    bundled = resources.files("rlcore.presets") / "models" / f"{name}.json"
    return str(bundled) if bundled.is_file() else os.path.expanduser(name)


def read_model_config(cfg: Config) -> dict:
    if cfg.model.path:
        path = os.path.join(os.path.expanduser(cfg.model.path), "config.json")
    elif cfg.model.hf_config:
        path = config_file(cfg.model.hf_config)
    else:
        raise ConfigError("--dry-run needs the model's sizes: set model.path (a checkpoint) or model.hf_config (a "
                          "config.json path, or a bundled name such as deepseek-v3)")
    return read_config(path, "model.path / model.hf_config")


def read_config(path: str, keys: str) -> dict:
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
    whole: int = 0  # whole on every TP rank: a vision-language model's vision tower (first stage)
    projector: int = 0   # of which its projector (rlcore.model_parts)


def stage_params(c, vocab_size: int, tied: bool, pp: int, last_stage_layers: int, lora=None,
                 tp: int = 1, ep: int = 1, output_rows: int | None = None, tower: int = 0,
                 projector: int = 0) -> list[StageParams]:
    """Parameters of each pipeline stage: embedding (and a vision ``tower`` of that many parameters, ``projector``
    of them its projector's) on the first, final norm and output layer on the last; with ``lora`` (actor.lora,
    rank > 0) also a TP rank's adapters.
    ``output_rows``: the output layer's rows, the vocabulary by default (1: a scalar head, a reward model's score
    head)."""
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
        stages.append(StageParams(dense, sum(e for _, e in layers), stage_adapters, stage_expert_adapters,
                                  tower if s == 0 else 0, projector if s == 0 else 0))
    return stages


def estimate(c, hf: dict, cfg: Config, reference: bool = False, tower: int = 0, projector: int = 0) -> dict:
    """Bytes of model state per device (busiest stage) and per node's CPU, with the offload settings applied;
    ``reference``: the algorithm keeps a frozen reference policy, a second copy of the parameters (with LoRA: none,
    the reference is the model with its adapters off). With LoRA, gradients and optimizer state are the adapters'
    only, and with ``actor.freeze`` the parts left unfrozen's: Megatron DDP and the optimizer skip frozen
    parameters."""
    p, world = cfg.actor.parallel, cfg.trainer.world_size
    dp, expert_dp = world // (p.tp * p.pp * p.cp), world // (p.ep * p.pp)
    lora = cfg.actor.lora.rank > 0
    reference = reference and not lora
    stages = stage_params(c, hf["vocab_size"], bool(hf.get("tie_word_embeddings")), p.pp, p.last_stage_layers,
                          cfg.actor.lora, p.tp, p.ep, tower=tower, projector=projector)
    bf16 = cfg.actor.dtype == "bfloat16"
    param_bytes = 2 if bf16 else 4
    fraction = cfg.actor.optim.offload_fraction       # hybrid_adam's (the plugin refuses it for adam)

    def trained(s: StageParams) -> tuple[float, float]:
        """(elements with gradients on one rank, their distributed-optimizer shard), the frozen parts left out."""
        parts = {"language_model": (s.dense / p.tp + s.experts / p.ep, s.dense / p.tp / dp + s.experts / p.ep /
                                    expert_dp),
                 "vision_tower": (s.whole - s.projector, (s.whole - s.projector) / dp),
                 "projector": (s.projector, s.projector / dp)}
        kept = [sizes for part, sizes in parts.items() if part not in cfg.actor.freeze]
        return sum(local for local, _ in kept), sum(shard for _, shard in kept)

    def stage_bytes(s: StageParams) -> dict[str, float]:
        local = s.dense / p.tp + s.experts / p.ep + s.whole
        with_grads, shard = trained(s)
        if lora:        # only the adapters have gradients and optimizer state (their distributed shard: / dp)
            with_grads = s.adapters
            shard = (s.adapters - s.expert_adapters) / dp + s.expert_adapters / expert_dp
        # a bf16 model's norms are fp32 (rlcore's torch norms): a few thousand elements a layer, counted as bf16
        device, host = optimizer_bytes(shard, shard if bf16 else 0, offloaded_elements(shard, fraction))
        return dict(params=(local + s.adapters) * param_bytes, grads=with_grads * 4, optimizer=device, host=host,
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
    return dict(total_params=sum(s.dense + s.experts + s.whole for s in stages), per_device=per_device,
                reference=ref, adapters_per_device=worst["adapters"],
                reference_on_host=ref_on_host, cpu_per_node_training=cpu * devices_per_node,
                cpu_per_node_rollout=during_rollout * devices_per_node, dp=dp, expert_dp=expert_dp,
                stages=len(stages))


def routes_memory(c, hf: dict, cfg: Config, dp: int) -> dict:
    """What routing replay (``actor.moe.routing_replay=rollout``) carries with the batch: every token's routed
    experts, top_k int16 ids per MoE layer (``rlcore.routed_experts``), in host memory. Per token; per sample at the
    responses' longest (``rollout.max_response_len``, the prompt not counted) and at the model's context (the
    longest sequence a run allows: the batch is padded to its longest row, so one such sequence sizes every row);
    per step's batch (``trainer.prompts_per_step`` x ``rollout.n`` samples), per data-parallel rank's share of it
    (``dp`` ranks), and per node: its object store holds each share its workers read once (``WorkerGroup._by_dp``),
    and they read the routes in place (``rlcore.data.READ_IN_PLACE``), so a node holds one share per data-parallel
    rank among its workers (ranks run TP, then CP, fastest). ``c``: the model's TransformerConfig, unsplit."""
    from rlcore.megatron.routing_replay import moe_layers
    from rlcore.routed_experts import route_bytes

    layers, top_k = len(moe_layers(c)), c.moe_router_topk
    context = (hf.get("text_config") or hf)["max_position_embeddings"]
    samples, devices = cfg.trainer.prompts_per_step * cfg.rollout.n, min(cfg.trainer.devices_per_node,
                                                                          cfg.trainer.world_size)
    shares = min(dp, max(1, devices // (cfg.actor.parallel.tp * cfg.actor.parallel.cp)))
    out = dict(layers=layers, top_k=top_k, per_token=route_bytes(1, layers, top_k), context=context,
               samples=samples, rank_samples=math.ceil(samples / dp), devices=devices, node_shares=shares)
    for name, tokens in (("response", cfg.rollout.max_response_len), ("context", context)):
        sample = route_bytes(tokens, layers, top_k)
        out.update({f"sample_{name}": sample, f"batch_{name}": samples * sample,
                    f"rank_{name}": out["rank_samples"] * sample, f"node_{name}": shares * out["rank_samples"]
                    * sample})
    return out


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

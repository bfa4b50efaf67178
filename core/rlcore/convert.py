"""Declarative Megatron <-> HF weight rules and the converter that applies them.

A model plugin lists rules such as ``Rename("decoder.layers.{layer}.mlp.linear_fc2.weight",
"model.layers.{layer}.mlp.down_proj.weight", tp_dim=1)``. The converter expands ``{layer}`` once per model into a
dictionary keyed by the concrete Megatron name, so converting a tensor is a lookup, never a scan.

Every rule converts in both directions and knows its tensor-parallel layout:
``to_hf(shards)`` takes the TP shards of one Megatron parameter (a single-element list at TP=1) and returns full
HF tensors; ``from_hf(hf, tp_rank, tp_size)`` returns this rank's Megatron shard from full HF tensors;
``shard_to_hf(shard, hf, tp_rank, tp_size)`` says where a TP rank's shard lands in the full HF tensors, as (view of
``hf``, view of ``shard``) pairs: the weight sync copies each rank's shard straight into HF layout, so that no rank
converts afterwards. ``tp_dim`` is the dimension Megatron splits (None: replicated).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar, Iterable, Iterator, Mapping, Protocol

import torch


@dataclass(frozen=True)
class Layout:
    """The model dimensions a rule may need."""
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int               # the HF vocabulary; Megatron's may be padded beyond it


class WeightRule(Protocol):
    """What the core asks of a rule (``Rename``, ``FusedQKV``, ``FusedGateUp`` or a plugin's own frozen dataclass
    whose string fields may hold ``{layer}`` / ``{expert}``)."""
    @property
    def megatron(self) -> str: ...
    @property
    def tp_dim(self) -> int | None: ...
    def hf_names(self) -> list[str]: ...
    def to_hf(self, shards: list[torch.Tensor], layout: Layout) -> list[tuple[str, torch.Tensor]]: ...
    def from_hf(self, hf: Mapping[str, torch.Tensor], layout: Layout, tp_rank: int, tp_size: int,
                padded_shape: torch.Size) -> torch.Tensor: ...
    def shard_to_hf(self, shard: torch.Tensor, hf: list[torch.Tensor], tp_rank: int, tp_size: int,
                    layout: Layout) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


def _cat(shards: list[torch.Tensor], dim: int | None) -> torch.Tensor:
    return shards[0] if dim is None or len(shards) == 1 else torch.cat(shards, dim)


def _shard(t: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    return t if dim is None or size == 1 else t.chunk(size, dim)[rank]


@dataclass(frozen=True)
class Rename:
    """One Megatron tensor is one HF tensor. ``tp_dim``: the dimension split under TP (None = replicated).
    ``vocab``: the first dimension is the (possibly padded) vocabulary, trimmed / padded on conversion."""
    megatron: str
    hf: str
    tp_dim: int | None = None
    vocab: bool = False

    def hf_names(self) -> list[str]:
        return [self.hf]

    def to_hf(self, shards, layout: Layout):
        full = _cat(shards, self.tp_dim)
        return [(self.hf, full[: layout.vocab_size] if self.vocab else full)]

    def from_hf(self, hf, layout: Layout, tp_rank: int, tp_size: int, padded_shape: torch.Size):
        t = hf[self.hf]
        if self.vocab and padded_shape[0] * tp_size > t.shape[0]:
            t = torch.cat([t, t.new_zeros(padded_shape[0] * tp_size - t.shape[0], *t.shape[1:])])
        return _shard(t, self.tp_dim, tp_rank, tp_size)

    def shard_to_hf(self, shard, hf, tp_rank: int, tp_size: int, layout: Layout):
        if not self.vocab:
            return [(_shard(hf[0], self.tp_dim, tp_rank, tp_size), shard)]
        start = tp_rank * shard.shape[0] if self.tp_dim == 0 else 0   # padding rows beyond the vocabulary are dropped
        rows = hf[0][start: min(start + shard.shape[0], layout.vocab_size)]
        return [(rows, shard[: rows.shape[0]])]


@dataclass(frozen=True)
class FusedQKV:
    """Megatron's ``linear_qkv``: per query group, [q heads of the group; k; v] stacked on dim 0, split under TP
    by whole query groups. HF keeps q, k, v as separate projections. Works for the weight and for the 1-D bias
    (Qwen2's ``add_qkv_bias``): the first dimension is laid out the same way, the rest is carried along."""
    megatron: str
    q: str
    k: str
    v: str
    tp_dim: ClassVar[int] = 0

    def hf_names(self) -> list[str]:
        return [self.q, self.k, self.v]

    def to_hf(self, shards, layout: Layout):
        full = _cat(shards, 0)
        g, d = layout.num_query_groups, layout.head_dim
        per_group = layout.num_heads // g
        rest = full.shape[1:]
        q, k, v = full.view(g, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
        return [(self.q, q.reshape(-1, *rest)), (self.k, k.reshape(-1, *rest)), (self.v, v.reshape(-1, *rest))]

    def from_hf(self, hf, layout: Layout, tp_rank: int, tp_size: int, padded_shape: torch.Size):
        g, d = layout.num_query_groups, layout.head_dim
        per_group = layout.num_heads // g
        q, k, v = (hf[n] for n in (self.q, self.k, self.v))
        rest = q.shape[1:]
        fused = torch.cat([q.view(g, per_group * d, *rest), k.view(g, d, *rest), v.view(g, d, *rest)], dim=1)
        return _shard(fused.reshape(-1, *rest), 0, tp_rank, tp_size)

    def shard_to_hf(self, shard, hf, tp_rank: int, tp_size: int, layout: Layout):
        g, d = layout.num_query_groups, layout.head_dim
        per_group = layout.num_heads // g
        rest = shard.shape[1:]
        groups = shard.shape[0] // ((per_group + 2) * d)          # the query groups this rank holds
        first = tp_rank * groups
        sources = shard.view(groups, per_group + 2, d, *rest).split([per_group, 1, 1], dim=1)
        heads = (per_group, 1, 1)
        return [(t.view(g, n, d, *rest)[first: first + groups], src) for t, n, src in zip(hf, heads, sources)]


@dataclass(frozen=True)
class FusedGateUp:
    """Megatron's gated ``linear_fc1``: each TP shard holds [gate_i; up_i]. HF keeps gate and up separate."""
    megatron: str
    gate: str
    up: str
    tp_dim: ClassVar[int] = 0

    def hf_names(self) -> list[str]:
        return [self.gate, self.up]

    def to_hf(self, shards, layout: Layout):
        halves = [s.chunk(2, 0) for s in shards]
        if len(halves) == 1:   # unsharded: both halves are contiguous views, no copy needed
            return [(self.gate, halves[0][0]), (self.up, halves[0][1])]
        return [(self.gate, torch.cat([h[0] for h in halves])), (self.up, torch.cat([h[1] for h in halves]))]

    def from_hf(self, hf, layout: Layout, tp_rank: int, tp_size: int, padded_shape: torch.Size):
        gate, up = hf[self.gate], hf[self.up]
        return torch.cat([_shard(gate, 0, tp_rank, tp_size), _shard(up, 0, tp_rank, tp_size)])

    def shard_to_hf(self, shard, hf, tp_rank: int, tp_size: int, layout: Layout):
        gate, up = shard.chunk(2, 0)
        return [(_shard(hf[0], 0, tp_rank, tp_size), gate), (_shard(hf[1], 0, tp_rank, tp_size), up)]


# Where a Llama-shaped decoder's tensors sit, on each side: layer-templated prefixes for the rule builders below
MEGATRON_LAYER, HF_LAYER = "decoder.layers.{layer}", "model.layers.{layer}"


def gated_mlp_rules(megatron: str, hf: str) -> list:
    """A SwiGLU MLP (gate/up fused in Megatron's linear_fc1, down as linear_fc2) under the given prefixes."""
    return [FusedGateUp(f"{megatron}.linear_fc1.weight", f"{hf}.gate_proj.weight", f"{hf}.up_proj.weight"),
            Rename(f"{megatron}.linear_fc2.weight", f"{hf}.down_proj.weight", tp_dim=1)]


def llama_style_rules(mlp: list, qkv_bias: bool, tied: bool) -> list:
    """The rules of a Llama-shaped decoder (embedding, RMSNorms, fused QKV with its bias if any, o_proj, the given
    MLP rules, final norm, lm_head unless tied), which Llama and Qwen2 share with each other and their MoE kin."""
    M, L = MEGATRON_LAYER, HF_LAYER
    qkv = [FusedQKV(f"{M}.self_attention.linear_qkv.{p}", *(f"{L}.self_attn.{n}_proj.{p}" for n in "qkv"))
           for p in (("weight", "bias") if qkv_bias else ("weight",))]
    rules = [Rename("embedding.word_embeddings.weight", "model.embed_tokens.weight", tp_dim=0, vocab=True),
             Rename(f"{M}.input_layernorm.weight", f"{L}.input_layernorm.weight"),
             *qkv,
             Rename(f"{M}.self_attention.linear_proj.weight", f"{L}.self_attn.o_proj.weight", tp_dim=1),
             Rename(f"{M}.pre_mlp_layernorm.weight", f"{L}.post_attention_layernorm.weight"),
             *mlp,
             Rename("decoder.final_layernorm.weight", "model.norm.weight")]
    if not tied:
        rules.append(Rename("output_layer.weight", "lm_head.weight", tp_dim=0, vocab=True))
    return rules


class WeightConverter:
    """Rules bound to one model: concrete Megatron name -> rule, built once. Rule names may hold ``{layer}``
    (decoder layer, counted over the whole model) and ``{expert}`` (MoE expert, counted over all experts)."""

    def __init__(self, rules: list[WeightRule], num_layers: int, layout: Layout, num_experts: int = 0):
        self.layout = layout
        self.by_megatron: dict[str, WeightRule] = {}
        for rule in rules:
            layers = range(num_layers) if "{layer}" in rule.megatron else [None]
            experts = range(num_experts) if "{expert}" in rule.megatron else [None]
            for i in layers:
                for e in experts:
                    bound = _bind(rule, i, e)
                    self.by_megatron[bound.megatron] = bound

    def replaced(self, rule: WeightRule) -> "WeightConverter":
        """This converter with ``rule`` in place of the one for its Megatron name (a reward model's score head in
        place of the vocabulary projection)."""
        other = copy.copy(self)
        other.by_megatron = {**self.by_megatron, rule.megatron: rule}
        return other

    def rule(self, megatron_name: str) -> WeightRule:
        try:
            return self.by_megatron[_local_name(megatron_name)]
        except KeyError:
            raise KeyError(f"no weight rule maps the Megatron parameter {megatron_name!r}; the model plugin's "
                           f"weight_rules must cover every parameter") from None

    def to_hf(self, megatron_name: str, shards: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        return self.rule(megatron_name).to_hf(shards, self.layout)

    def hf_names(self) -> list[str]:
        return [n for r in self.by_megatron.values() for n in r.hf_names()]

    def megatron_from_hf(self, hf: Mapping[str, torch.Tensor], local_params: Iterable[tuple[str, torch.Tensor]],
                         tp_rank: int = 0, tp_size: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's Megatron tensors from full HF tensors, for the given local parameter names and shapes."""
        for name, param in local_params:
            rule = self.rule(name)
            missing = [n for n in rule.hf_names() if n not in hf]
            if missing:
                raise KeyError(f"HF checkpoint lacks {missing} needed for Megatron parameter {name!r}")
            yield name, rule.from_hf(hf, self.layout, tp_rank, tp_size, param.shape)


# TransformerEngine's layer specs fuse a norm into the linear layer after it; its weight then lives on that layer.
# Rules are written against megatron-core's local spec, so TE names are looked up under their local equivalents.
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_q_down_proj.layer_norm_weight": "input_layernorm.weight",   # MLA with query compression
    "self_attention.linear_q_proj.layer_norm_weight": "input_layernorm.weight",        # MLA without
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


def _local_name(megatron_name: str) -> str:
    head, _, tail = megatron_name.partition(".layers.")
    layer, _, rest = tail.partition(".")
    local = _TE_FUSED_NORMS.get(rest)
    return f"{head}.layers.{layer}.{local}" if local else megatron_name


def _bind(rule: WeightRule, layer: int | None, expert: int | None = None) -> WeightRule:
    fields = {k: (v.format(layer=layer, expert=expert) if isinstance(v, str) else v) for k, v in rule.__dict__.items()}
    return type(rule)(**fields)

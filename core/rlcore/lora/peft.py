"""rlcore's LoRA adapters in PEFT's names and layout: what ``peft.PeftModel.from_pretrained`` loads onto the HF model.

One rlcore adapter sits on one Megatron linear, which may be several HF projections fused (q/k/v in linear_qkv,
gate/up in a gated linear_fc1). The model plugin's weight rule that turns W into HF tensors turns the adapter's
factors into PEFT's per-projection ones too, because each factor's TP-split dimension follows W's
(``rlcore.lora.layers``):

- column-parallel (W [out, in] split by rows): B [out, r]'s rows follow W's, so the rule splits and names B as it does
  W (q/k/v_proj, gate/up_proj each get their rows of B as ``lora_B``); A [r, in] is every projection's ``lora_A``.
  Then B_proj A is W_proj's part of B A: the fused adapter equals the projections' adapters sharing A.
- row-parallel (W [out, in] split by columns): A [r, in]'s columns follow W's, so the rule gives ``lora_A``; B is
  ``lora_B`` as it is.

The scale needs no conversion: rlcore's is alpha / rank, PEFT's without rsLoRA the same.

Pure tensors and names, no PEFT import: an export must not need PEFT installed to write its format.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from rlcore.convert import WeightConverter

if TYPE_CHECKING:
    from rlcore.lora.config import LoRAConfig

# PeftModel wraps the HF model twice (PeftModelForCausalLM.base_model = LoraModel, whose .model is the HF model);
# save_pretrained writes the keys under that prefix with the adapter's name left out
PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_factors(converter: WeightConverter, weight_name: str, a_shards: list[torch.Tensor],
                 b_shards: list[torch.Tensor], column: bool) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF module name, lora_A [r, in], lora_B [out, r]) per HF projection of the adapted Megatron weight
    ``weight_name`` (global name, as ``adapted_weights`` keys it). ``a_shards`` / ``b_shards``: the factors' TP shards
    in the order the weight's own shards go to its rule (one each at TP1); the replicated factor (column: A, row: B)
    is taken from the first. ``column``: the adapter is column-parallel (``ColumnLoRA``), else row-parallel."""
    split, whole = (b_shards, a_shards[0]) if column else (a_shards, b_shards[0])
    factors = []
    for hf_name, part in converter.to_hf(weight_name, split):
        module = _module(hf_name, weight_name)
        a, b = (whole, part) if column else (part, whole)
        factors.append((module, a.contiguous(), b.contiguous()))
    return factors


def peft_state_dict(factors: Iterable[tuple[str, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors of ``adapter_model.safetensors``, keyed as PEFT's ``save_pretrained`` keys them, from
    ``peft_factors``' triples. A fused linear's projections share its A: each gets a copy, since safetensors
    refuses tensors that share memory."""
    state = {}
    seen: set[int] = set()
    for module, a, b in factors:
        for key, t in ((f"{PEFT_PREFIX}{module}.lora_A.weight", a), (f"{PEFT_PREFIX}{module}.lora_B.weight", b)):
            state[key] = t.clone() if t.untyped_storage().data_ptr() in seen else t
            seen.add(t.untyped_storage().data_ptr())
    return state


def target_modules(adapted: Iterable[str], hf_weight_names: Iterable[str]) -> list[str]:
    """PEFT's ``target_modules`` for exactly the HF modules ``adapted``: PEFT matches a name in the list against the
    end of each module's name, so the projections' short names (q_proj, ...) serve when every module of the model
    with such a short name is adapted; otherwise (a model whose other layers, e.g. experts, reuse a short name)
    the full module names. ``hf_weight_names``: all of the model's HF tensors (``converter.hf_names()``)."""
    adapted = set(adapted)
    short = {m.rsplit(".", 1)[-1] for m in adapted}
    same_short = {m for m in (_strip_weight(n) for n in hf_weight_names) if m and m.rsplit(".", 1)[-1] in short}
    return sorted(short) if same_short <= adapted else sorted(adapted)


def adapter_config(lora: LoRAConfig, modules: list[str], base_model_name_or_path: str | None,
                   parameters: list[str] | None = None) -> dict:
    """PEFT's ``adapter_config.json`` for adapters on ``modules`` (PEFT's target_modules: ``target_modules``) and
    on the MoE experts' parameters ``parameters`` (PEFT's target_parameters: ``expert_target_parameters``)."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": alpha,
        # PEFT refuses dropout on expert parameters (ParamWrapper); off at inference, it changes no logits
        "lora_dropout": 0.0 if parameters else lora.dropout,
        "target_modules": list(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "target_parameters": list(parameters) if parameters else None,
    }


# transformers (5.x) holds a MoE layer's routed experts as 3-D parameters of its ``experts`` module, registered in this
# order: gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows) and down_proj [E, H, I], built on load
# from the checkpoint's per-expert tensors (its conversion_mapping, which also renames Mixtral's block_sparse_moe to
# mlp). PEFT adapts them with ``target_parameters``: one ParamWrapper per parameter, the first registered innermost.
EXPERT_PARAMETERS = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}
_EXPERTS_MODULE = re.compile(r"^(?P<experts>.+\.experts)\.\d+\.[^.]+$")
_MOE_BLOCK_RENAMES = {".block_sparse_moe.": ".mlp."}
_ROUTED_EXPERT = re.compile(r"^(?P<layer>.+)\.local_experts\.(?P<expert>\d+)\.(?P<fc>linear_fc[12])\.weight$")


def peft_expert_factors(converter: WeightConverter, experts: list[tuple[str, torch.Tensor, torch.Tensor]]
                        ) -> tuple[str, str, torch.Tensor, torch.Tensor]:
    """PEFT's parameter LoRA of one MoE layer's routed experts' fc1 or fc2: (experts module, parameter name,
    lora_A [r E, in], lora_B [out, r E]) from rlcore's adapters on every expert of the layer, ``experts``: (global
    weight name, A, B) in expert order, each whole (expert TP 1), mapped per expert as ``peft_factors`` maps a dense
    adapter (fc1's gate and up rows of B concatenated, as transformers concatenates the weights).

    PEFT's ParamWrapper is a rank-r LoRA per expert, stacked: expert e's A is rows e r .. (e+1) r of lora_A, its B
    the columns e, E + e, 2E + e, ... of lora_B (lora_B viewed [out, r, E]); it adds scale B_e A_e to expert e's
    weight, which is what rlcore's expert adapter adds, so every rlcore expert adapter has exactly one PEFT form.
    PEFT cannot express dropout there (it refuses lora_dropout != 0 on parameters)."""
    fc = experts[0][0].rsplit(".", 2)[-2]
    if fc not in EXPERT_PARAMETERS:
        raise ValueError(f"{experts[0][0]!r} is not a routed expert's linear_fc1 / linear_fc2")
    return stacked_experts(fc, [peft_factors(converter, name, [a], [b], column=fc == "linear_fc1")
                                for name, a, b in experts])


def routed_expert(weight_name: str) -> tuple[str, int, str] | None:
    """(the layer's experts, the expert's index, linear_fc1 or linear_fc2) of a routed expert's fc1/fc2 weight (global
    Megatron name); None for any other weight."""
    match = _ROUTED_EXPERT.match(weight_name)
    return (match["layer"], int(match["expert"]), match["fc"]) if match else None


def stacked_experts(fc: str, per_expert: list[list[tuple[str, torch.Tensor, torch.Tensor]]]
                    ) -> tuple[str, str, torch.Tensor, torch.Tensor]:
    """``peft_expert_factors`` from each expert's ``peft_factors`` in expert order (``fc``: linear_fc1 or
    linear_fc2), as an export that reads them from a checkpoint has them."""
    match = _EXPERTS_MODULE.match(per_expert[0][0][0])
    if match is None:
        raise ValueError(f"the weight rule names the expert projection {per_expert[0][0][0]!r}, not "
                         "'<...>.experts.<e>.<projection>': PEFT's expert parameters cannot be located")
    module = match["experts"]
    for old, new in _MOE_BLOCK_RENAMES.items():
        module = module.replace(old, new)
    lora_a = torch.cat([projections[0][1] for projections in per_expert])                          # [r E, in]
    lora_b = torch.stack([torch.cat([b for _, _, b in projections]) for projections in per_expert], 2)  # [out, r, E]
    return module, EXPERT_PARAMETERS[fc], lora_a, lora_b.reshape(lora_b.shape[0], -1)


def peft_expert_state_dict(layers: Iterable[tuple[str, str, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors of ``adapter_model.safetensors`` for ``peft_expert_factors``' results, keyed as PEFT's
    save_pretrained keys them: an experts module whose gate_up_proj and down_proj are both adapted holds down_proj's
    wrapper around gate_up_proj's (``<experts>.base_layer.lora_A``: gate_up_proj's)."""
    layers = list(layers)
    adapted: dict[str, set[str]] = {}
    for module, parameter, _, _ in layers:
        adapted.setdefault(module, set()).add(parameter)
    order = list(EXPERT_PARAMETERS.values())
    state = {}
    for module, parameter, a, b in layers:
        outer = sum(1 for p in adapted[module] if order.index(p) > order.index(parameter))
        prefix = f"{PEFT_PREFIX}{module}{'.base_layer' * outer}"
        state[f"{prefix}.lora_A.weight"], state[f"{prefix}.lora_B.weight"] = a.contiguous(), b.contiguous()
    return state


def expert_target_parameters(layers: Iterable[tuple[str, str, torch.Tensor, torch.Tensor]]) -> list[str]:
    """PEFT's ``target_parameters`` for ``peft_expert_factors``' results (matched against the end of each
    parameter's name: ``experts.gate_up_proj`` names every MoE layer's)."""
    return sorted({f"experts.{parameter}" for _, parameter, _, _ in layers})


def peft_adapter(weights: Iterable[tuple[str, list[tuple[str, torch.Tensor, torch.Tensor]]]], hf_weight_names:
                 Iterable[str], module_name: Callable[[str], str] | None = None,
                 ) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """A whole PEFT adapter from each adapted weight's (global name, ``peft_factors``): the tensors of
    ``adapter_model.safetensors``, PEFT's target_modules and target_parameters (for ``adapter_config``). A MoE
    layer's routed experts are stacked into PEFT's parameter LoRA (``stacked_experts``), the rest per projection.
    ``hf_weight_names``: all of the model's HF tensors (``converter.hf_names()``); ``module_name``: the family's
    (``ModelSpec.module_name``), where transformers' modules are named otherwise than the checkpoint's tensors."""
    rename = module_name or (lambda name: name)
    hf_weight_names = [rename(name) for name in hf_weight_names]
    weights = ((name, [(rename(module), a, b) for module, a, b in factors]) for name, factors in weights)
    state: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    experts: dict[tuple[str, str], list] = {}   # a MoE layer's fc1 or fc2: (expert, its factors) of every expert
    for name, factors in weights:
        expert = routed_expert(name)
        if expert:
            experts.setdefault((expert[0], expert[2]), []).append((expert[1], factors))
        else:
            modules += [m for m, _, _ in factors]
            state |= peft_state_dict(factors)
    layers = [stacked_experts(fc, [f for _, f in sorted(each, key=lambda e: e[0])])
              for (_, fc), each in experts.items()]
    state |= peft_expert_state_dict(layers)
    return state, target_modules(modules, hf_weight_names), expert_target_parameters(layers)


def _strip_weight(hf_name: str) -> str | None:
    return hf_name[: -len(".weight")] if hf_name.endswith(".weight") else None


def _module(hf_name: str, weight_name: str) -> str:
    module = _strip_weight(hf_name)
    if module is None:
        raise ValueError(f"the weight rule for the adapted {weight_name!r} names the HF tensor {hf_name!r}, not a "
                         "module's '.weight': PEFT adapts linear modules; adapt another linear or fix the rule")
    return module

"""rlcore's LoRA adapters in PEFT's names and layout: what ``peft.PeftModel.from_pretrained`` loads onto the HF model.

One rlcore adapter sits on one Megatron linear, which may be several HF projections fused (q/k/v in linear_qkv,
gate/up in a gated linear_fc1). The model plugin's weight rule that turns W into HF tensors turns the adapter's
factors into PEFT's per-projection ones too, because each factor's TP-split dimension follows W's
(``rlcore.megatron.lora``):

- column-parallel (W [out, in] split by rows): B [out, r]'s rows follow W's, so the rule splits and names B as it does
  W (q/k/v_proj, gate/up_proj each get their rows of B as ``lora_B``); A [r, in] is every projection's ``lora_A``.
  Then B_proj A is W_proj's part of B A: the fused adapter equals the projections' adapters sharing A.
- row-parallel (W [out, in] split by columns): A [r, in]'s columns follow W's, so the rule gives ``lora_A``; B is
  ``lora_B`` as it is.

The scale needs no conversion: rlcore's is alpha / rank, PEFT's without rsLoRA the same.

Pure tensors and names, no PEFT import: an export must not need PEFT installed to write its format.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from rlcore.convert import WeightConverter

if TYPE_CHECKING:
    from rlcore.megatron.lora import LoRAConfig

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
    ``peft_factors``' triples."""
    state = {}
    for module, a, b in factors:
        state[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
        state[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
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


def adapter_config(lora: LoRAConfig, modules: list[str], base_model_name_or_path: str | None) -> dict:
    """PEFT's ``adapter_config.json`` for adapters on ``modules`` (PEFT's target_modules: ``target_modules``)."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": alpha,
        "lora_dropout": lora.dropout,
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
    }


def _strip_weight(hf_name: str) -> str | None:
    return hf_name[: -len(".weight")] if hf_name.endswith(".weight") else None


def _module(hf_name: str, weight_name: str) -> str:
    module = _strip_weight(hf_name)
    if module is None:
        raise ValueError(f"the weight rule for the adapted {weight_name!r} names the HF tensor {hf_name!r}, not a "
                         "module's '.weight': PEFT adapts linear modules; adapt another linear or fix the rule")
    return module

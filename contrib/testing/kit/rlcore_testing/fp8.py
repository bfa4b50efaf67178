"""Test checkpoints in the published block FP8 format (DeepSeek-V3, Qwen3-FP8), written from a plain HF checkpoint
with safetensors' own writer, for the loader's FP8 tests (tests/e2e/test_fp8_checkpoint.py)."""
from __future__ import annotations

import json
import os
import shutil

import torch

_FP8_MAX = 448.0     # the largest float8_e4m3fn value


def quantize_checkpoint(src: str, dst: str, block: tuple[int, int] = (128, 128), shard_bytes: int = 0,
                        mtp_layers: int = 0) -> dict[str, torch.Tensor]:
    """Write ``src``'s HF checkpoint to ``dst`` in the published block FP8 format (DeepSeek-V3, Qwen3-FP8): every
    linear weight of attention and MLP/experts (``*_proj.weight``) as float8_e4m3fn plus a float32
    ``*_proj.weight_scale_inv`` of one scale per block (amax / 448, partial edge blocks included), the rest as is;
    ``quantization_config`` in config.json; files of at most ``shard_bytes`` with an index (0: one file);
    ``mtp_layers`` multi-token-prediction layers after the last decoder layer, as DeepSeek-V3 publishes one (a copy
    of layer 0's tensors plus enorm, hnorm, eh_proj, shared_head). Written with safetensors' own writer. Returns the
    quantized tensors, FP8 values and scales, by name."""
    from safetensors.torch import save_file

    from rlcore.hf_checkpoint import HFCheckpoint

    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    original = dict(HFCheckpoint(src, config))
    layers = config["num_hidden_layers"]
    for m in range(mtp_layers):
        prefix = f"model.layers.{layers + m}."
        original.update({prefix + n[len("model.layers.0."):]: t.clone() for n, t in original.items()
                         if n.startswith("model.layers.0.")})
        h = config["hidden_size"]
        original.update({prefix + "enorm.weight": torch.ones(h), prefix + "hnorm.weight": torch.ones(h),
                         prefix + "eh_proj.weight": torch.randn(h, 2 * h) * 0.02,
                         prefix + "shared_head.norm.weight": torch.ones(h),
                         prefix + "shared_head.head.weight": original["lm_head.weight"].clone(),
                         prefix + "embed_tokens.weight": original["model.embed_tokens.weight"].clone()})
    stored: dict[str, torch.Tensor] = {}
    b0, b1 = block
    for name, t in original.items():
        if not (name.endswith("_proj.weight") and t.dim() == 2):
            stored[name] = t.contiguous()
            continue
        rows, cols = t.shape
        scale = torch.empty(-(-rows // b0), -(-cols // b1))
        q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                w = t[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
                scale[i, j] = w.abs().max().clamp(min=1e-12) / _FP8_MAX
                q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (w / scale[i, j]).to(torch.float8_e4m3fn)
        stored[name], stored[name + "_scale_inv"] = q, scale
    os.makedirs(dst, exist_ok=True)
    files: list[dict[str, torch.Tensor]] = [{}]
    for name, t in stored.items():
        if shard_bytes and files[-1] and sum(x.nbytes for x in files[-1].values()) + t.nbytes > shard_bytes:
            files.append({})
        files[-1][name] = t
    if len(files) == 1:
        save_file(files[0], os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, part in enumerate(files):
            file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            save_file(part, os.path.join(dst, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(t.nbytes for t in stored.values())}, "weight_map": weight_map},
                      f)
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    for name in os.listdir(src):          # tokenizer files, if any
        if not (name.endswith(".safetensors") or name.endswith(".json") and name.startswith(("config", "model"))):
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return stored

"""What a checkpoint written by `rlcore convert` (``rlcore.hf_to_megatron``) is, for its readers: the marker file that
names it (family, dtype, source, layout) and where its Megatron weights are. Apart from the convert command, so that
reading a config, loading a model or exporting one does not import the command."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

MARKER = "rlcore_converted.json"
WEIGHTS = "megatron"


@dataclass(frozen=True)
class ConvertedWeights:
    """A converted checkpoint's weights: what a rank loads its shard from instead of HF files."""
    path: str

    @property
    def directory(self) -> str:
        return os.path.join(self.path, WEIGHTS)


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def converted_dtype(path: str) -> str | None:
    """The dtype ``path``'s weights were written at by ``rlcore convert`` (None: not a converted checkpoint)."""
    if not is_converted(path):
        return None
    with open(os.path.join(path, MARKER)) as f:
        return json.load(f).get("dtype")


def starts_weightless(model_path: str, hf_config: dict) -> bool:
    """An engine cannot start from files that are not the model the actor loaded (block FP8, dequantized on load; a
    converted checkpoint's Megatron weights): it starts from the config without weights, and the first push gives it
    the actor's."""
    from rlcore.quantization import checkpoint_quantization

    return is_converted(model_path) or checkpoint_quantization(hf_config) is not None

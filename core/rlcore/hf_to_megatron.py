"""`rlcore convert <hf dir> <out dir> --tp T --pp P --ep E`: an HF checkpoint written once as megatron-core's
distributed checkpoint, which runs then start from (``model.path=<out dir>``), each rank reading only its own shard,
at the conversion's layout or any other (the format reshards on load).

The conversion runs T x P x E processes (torchrun; gloo on CPU, NCCL on GPUs), each loading its shard from the HF
files lazily (``rlcore.hf_checkpoint``: block FP8 dequantized, MTP layers skipped) and writing it; no process holds
more than its shard. The output directory holds the HF config (less any ``quantization_config``), the tokenizer, the
weights under ``megatron/`` and ``rlcore_converted.json`` (family, dtype, source, layout).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from rlcore.converted import MARKER, WEIGHTS
from rlcore.errors import ConfigError
from rlcore.launch import torchrun


def convert(hf_dir: str, out: str, family: str | None = None, tp: int = 1, pp: int = 1, ep: int = 1,
            dtype: str = "bfloat16", plugin_names: list[str] | None = None) -> str:
    """Write ``hf_dir`` as a converted checkpoint in ``out`` at this layout (see the module docstring); ``family``:
    the model plugin's name (default: the one registered for the checkpoint's architecture)."""
    from rlcore.hf_checkpoint import weightless_copy
    from rlcore.megatron.model import DTYPES, check_model_config, read_hf_config
    from rlcore.plugins import load_plugins

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConfigError(f"{hf_dir!r} is not an HF checkpoint directory (no config.json)")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if min(tp, pp, ep) < 1:
        raise ConfigError(f"--tp {tp} --pp {pp} --ep {ep}: each must be >= 1")
    registry = load_plugins(plugin_names).registry
    hf_config = read_hf_config(hf_dir)
    family = family or _family_of(hf_config, registry)
    spec = registry.get("models", family)
    try:
        check_model_config(spec, hf_config, dtype)
    except ValueError as e:
        raise ConfigError(f"{hf_dir}: {e}") from e
    if os.path.exists(out) and os.listdir(out):
        raise ConfigError(f"{out!r} exists and is not empty: give a new directory")
    weightless_copy(hf_dir, out)           # config (dequantized: no quantization_config) and tokenizer
    command = [*torchrun(tp * pp * ep), "-m", "rlcore.hf_to_megatron", hf_dir, out, family, str(tp), str(pp), str(ep),
               dtype, ",".join(plugin_names) if plugin_names is not None else "*"]
    result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if result.returncode != 0:
        raise ConfigError(f"converting {hf_dir} failed in one of its {tp * pp * ep} processes (its error is above)")
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump({"family": family, "dtype": dtype, "source": os.path.abspath(hf_dir),
                   "layout": {"tp": tp, "pp": pp, "ep": ep}}, f, indent=2)
    return out


def _family_of(hf_config: dict, registry) -> str:
    arch = (hf_config.get("architectures") or ["?"])[0]
    families = [name for name, spec in registry.models.items() if arch in spec.hf_architectures]
    if len(families) != 1:
        raise ConfigError(f"the checkpoint is a {arch}, which {'no' if not families else 'more than one'} installed "
                          f"model plugin handles ({', '.join(families) or 'none'}): name one with --family")
    return families[0]


def _rank(hf_dir: str, out: str, family: str, tp: int, pp: int, ep: int, dtype: str, plugins: str) -> None:
    """One process of the conversion: its shard from the HF files, written into ``out``/megatron."""
    import torch

    from rlcore.megatron.checkpoint import save_weights
    from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights
    from rlcore.megatron.parallel import init_parallel, shutdown_parallel
    from rlcore.plugins import load_plugins

    torch.set_num_threads(1)
    spec = load_plugins(None if plugins == "*" else plugins.split(",")).registry.get("models", family)
    init_parallel(tp=tp, pp=pp, ep=ep, seed=0)
    model, converter = build_gpt(spec, read_hf_config(hf_dir), dtype)
    load_hf_into(model, converter, read_hf_weights(hf_dir))
    save_weights(model, os.path.join(out, WEIGHTS))
    del model, converter
    shutdown_parallel()


if __name__ == "__main__":
    hf, target, fam, t, p, e, dt, names = sys.argv[1:9]
    _rank(hf, target, fam, int(t), int(p), int(e), dt, names)

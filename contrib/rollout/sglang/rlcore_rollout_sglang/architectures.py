"""Which models the pinned SGLang serves, decided in the controller before any worker starts (an engine that cannot
load a model fails only in its spawned scheduler, after the workers have started and the model was warm-started)."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
from functools import lru_cache

VERSION = "0.5.23"
_ENTRY = re.compile(r"^EntryClass\s*=\s*(\[[^\]]*\]|\w+)", re.MULTILINE)

# Architectures SGLang lists but cannot serve on a CPU with this project's shims, and why (measured on tiny
# checkpoints against transformers' logprobs; the README's table).
CPU_LIMITS = {
    "DeepseekV3ForCausalLM": "SGLang's CPU path for DeepSeek's MLA accepts only yarn rope scaling (it asserts "
                             "without), and with it disagrees with transformers by 0.22 in logprob on a tiny "
                             "DeepSeek-V3",
}


@lru_cache(maxsize=1)
def served_architectures() -> frozenset[str]:
    """The architectures SGLang's model registry lists (each ``sglang/srt/models`` module's ``EntryClass``), read
    from the installed source: importing the registry takes ~14 s here and needs the CPU shims."""
    return frozenset(name for names in entry_classes().values() for name in names)


def entry_classes() -> dict[str, list[str]]:
    """Model module name -> the class names its ``EntryClass`` registers."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return {}
    models = os.path.join(list(spec.submodule_search_locations)[0], "srt", "models")
    found = {}
    for path in sorted(glob.glob(os.path.join(models, "*.py"))):
        with open(path, encoding="utf-8") as f:
            match = _ENTRY.search(f.read())
        if match:
            found[os.path.basename(path)[:-3]] = re.findall(r"[A-Za-z_]\w*", match.group(1))
    return found


def unservable(hf_config: dict, on_cpu: bool) -> str | None:
    """Why SGLang cannot serve the model of ``hf_config`` (None: it can)."""
    arch = (hf_config.get("architectures") or ["?"])[0]
    if arch not in served_architectures():
        return f"SGLang {VERSION} has no model class for architecture {arch}"
    if arch == "MixtralForCausalLM" and hf_config.get("head_dim") is not None:
        derived = hf_config["hidden_size"] // hf_config["num_attention_heads"]
        if hf_config["head_dim"] != derived:
            return (f"SGLang's Mixtral derives head_dim from hidden_size / num_attention_heads = {derived} and "
                    f"ignores the config's head_dim = {hf_config['head_dim']}")
    if on_cpu and arch in CPU_LIMITS:
        return f"{CPU_LIMITS[arch]} (it is served on GPUs)"
    return None

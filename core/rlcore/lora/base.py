"""A LoRA checkpoint holds the adapters only: what they apply to is recorded as a fingerprint of the base model's
weight files, checked when the run resumes and when it is exported merged."""
from __future__ import annotations

import glob
import os

SAMPLED_BYTES = 1 << 20


def base_fingerprint(model_path: str) -> dict[str, list]:
    """What a LoRA checkpoint's adapters apply to, which the checkpoint does not hold: each weight file of the HF
    checkpoint ``model_path`` as [size, sha256 of its first and last MiB]. Reads 2 MiB per file at any model size;
    another checkpoint differs in a name or size, or in the header and the first and last tensors' bytes."""
    import hashlib

    found = {}
    for file in sorted(glob.glob(os.path.join(model_path, "*.safetensors"))):
        size = os.path.getsize(file)
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            digest.update(f.read(SAMPLED_BYTES))
            f.seek(max(0, size - SAMPLED_BYTES))
            digest.update(f.read(SAMPLED_BYTES))
        found[os.path.basename(file)] = [size, digest.hexdigest()]
    return found


def base_differences(recorded: dict[str, list], model_path: str) -> list[str]:
    """The weight files in which ``model_path`` differs from a LoRA checkpoint's recorded base
    (``base_fingerprint``)."""
    now = base_fingerprint(model_path)
    return sorted(name for name in set(recorded) | set(now) if recorded.get(name) != now.get(name))

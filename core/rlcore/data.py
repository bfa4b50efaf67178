"""The batch that flows between controller and workers: tensors with a leading sample dimension + per-sample
metadata. Sequences are prompt + response, right-padded; per-token tensors are aligned with *label* positions
(position t scores token t+1), which is what a causal LM's forward produces."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch

from rlcore.routed_experts import ROUTED_EXPERTS


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor]
    meta: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        assert value.shape[0] == len(self), f"{key}: leading dim {value.shape[0]} != batch size {len(self)}"
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def select(self, index: torch.Tensor | Sequence[int]) -> "Batch":
        index = torch.as_tensor(index, dtype=torch.long)
        return Batch({k: v[index] for k, v in self.tensors.items()},
                     [self.meta[i] for i in index.tolist()] if self.meta else [])

    def split(self, size: int) -> list["Batch"]:
        """Consecutive pieces of at most ``size`` samples."""
        return [self.select(range(i, min(i + size, len(self)))) for i in range(0, len(self), size)]

    def __reduce__(self):
        """Pickled as raw numpy bytes: Ray writes numpy buffers into its object store out of band and reads them back
        in place, where torch tensors would go through ``torch.save`` and several copies each way."""
        return _unpickle_batch, ({k: _raw(v) for k, v in self.tensors.items()}, self.meta)


def _raw(t: torch.Tensor) -> tuple:
    """A tensor's bytes as a flat uint8 array (every dtype, bfloat16 too), its dtype and shape."""
    t = t.detach().contiguous()
    return t.view(-1).view(torch.uint8).numpy(), t.dtype, tuple(t.shape)


# what the workers only read (index, never write): left in the object store's shared memory, one copy per node for
# all its ranks rather than one per rank; the routed experts (rlcore.routed_experts) are most of a batch's bytes
READ_IN_PLACE = frozenset({ROUTED_EXPERTS})


def _unpickle_batch(raw: dict[str, tuple], meta: list[dict]) -> Batch:
    """A read-only array is the object store's shared memory, read by every rank of a data-parallel share: copied
    once, so that each rank owns tensors it may write (but ``READ_IN_PLACE``'s, used where they lie). Plain pickle
    gives writable arrays, kept as they are."""
    def tensor(key: str, data, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        if data.flags.writeable or key not in READ_IN_PLACE:
            return torch.from_numpy(data if data.flags.writeable else data.copy()).view(dtype).view(shape)
        with warnings.catch_warnings():     # torch warns of every read-only array; these are only read
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data).view(dtype).view(shape)

    return Batch({k: tensor(k, *r) for k, r in raw.items()}, meta)


def sequence_lengths(batch: Batch) -> torch.Tensor:
    """Each row's tokens (prompt and response); the full width where rows do not say."""
    width = batch["input_ids"].shape[1]
    if "prompt_len" not in batch.tensors:
        return torch.full((len(batch),), width, dtype=torch.long)
    return (batch["prompt_len"] + batch["response_len"]).clamp(max=width)


def build_sequences(prompts: Sequence[list[int]], responses: Sequence[list[int]], pad_id: int,
                    response_logprobs: Sequence[list[float]] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response token ids, label-aligned response mask, and the engine's logprobs."""
    n = len(prompts)
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    response_mask = torch.zeros((n, length), dtype=torch.float32)
    rollout_logprobs = torch.zeros((n, length), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        start = len(p) - 1                      # label position of the first response token
        response_mask[i, start: start + len(r)] = 1.0
        if response_logprobs is not None:
            rollout_logprobs[i, start: start + len(r)] = torch.tensor(response_logprobs[i], dtype=torch.float32)
    out = dict(input_ids=input_ids, response_mask=response_mask,
               prompt_len=torch.tensor([len(p) for p in prompts]),
               response_len=torch.tensor([len(r) for r in responses]))
    if response_logprobs is not None:
        out["rollout_logprobs"] = rollout_logprobs
    return out

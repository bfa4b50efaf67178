"""HF checkpoints as published, read and written one tensor at a time, so that no process ever holds a whole model.

Reading: ``HFCheckpoint(path)`` is a lazy, read-only mapping from tensor name to tensor over one ``*.safetensors``
file or several with ``model.safetensors.index.json``. A tensor is read when it is looked up, with positioned reads
of exactly its bytes (no memory map: mapped pages would stay resident and count against the rank), and dequantized
on the way when the checkpoint is block FP8 (``rlcore.quantization``). The model plugins' weight rules read it as they
read a dict, so a rank builds its shard from the tensors its rules ask for: its pipeline stage's layers, its experts,
one full tensor at a time cut to its TP slice. Peak memory while loading is the rank's shard plus about one tensor.

Writing: ``write_sharded`` writes HF's sharded layout (``model-0000k-of-0000n.safetensors`` of at most
``max_shard_bytes`` each, plus the index; one ``model.safetensors`` when it fits) from a stream of tensors whose names,
shapes and dtypes are known in advance (the resharder's plan): each file's header is written first and every tensor's
bytes are appended as it arrives, so the writer holds nothing.

The safetensors layout (8-byte little-endian header length, a JSON header of dtype / shape / data offsets, then the
bytes) is the published format; files written here load in transformers, vLLM and ``safetensors`` itself.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from rlcore.quantization import SCALE_SUFFIX, checkpoint_quantization

log = logging.getLogger("rlcore.load")     # shown at INFO by `rlcore run` and its workers: loading is slow at scale

INDEX = "model.safetensors.index.json"
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
PROGRESS_BYTES = 1 << 30        # checkpoints from this size on log each file as its reading starts


@dataclass(frozen=True)
class StoredTensor:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int             # absolute byte offsets in the file
    end: int


def read_header(file: str) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file: where its bytes are, its dtype and shape."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has dtype {meta['dtype']}, which rlcore does not read")
        begin, end = meta["data_offsets"]
        out[name] = StoredTensor(file, DTYPES[meta["dtype"]], tuple(meta["shape"]), base + begin, base + end)
    return out


def read_tensor(stored: StoredTensor) -> torch.Tensor:
    """The tensor's bytes, read into fresh memory of exactly its size."""
    data = torch.empty(stored.end - stored.start, dtype=torch.uint8)
    view = data.numpy().data
    with open(stored.file, "rb", buffering=0) as f:
        f.seek(stored.start)
        done = 0
        while done < len(view):            # one read returns at most ~2 GB on Linux
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{stored.file} ends inside a tensor: the file is truncated")
            done += n
    return data.view(stored.dtype).reshape(stored.shape)


@dataclass
class ReadStats:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    files: set[str] = field(default_factory=set)


class HFCheckpoint(Mapping[str, torch.Tensor]):
    """A lazy view of the HF checkpoint in directory ``path`` (see the module docstring). Iterating yields the
    weights' names (FP8 scales are part of their weights); looking one up reads it."""

    def __init__(self, path: str, hf_config: dict | None = None):
        self.path = str(path)
        if hf_config is None:
            with open(os.path.join(self.path, "config.json")) as f:
                hf_config = json.load(f)
        self.quantization = checkpoint_quantization(hf_config)
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
            self.files = sorted(set(weight_map.values()))
            self._file_of = {n: os.path.join(self.path, f) for n, f in weight_map.items()}
        else:
            self.files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            self._file_of = {n: os.path.join(self.path, f) for f in self.files
                             for n in read_header(os.path.join(self.path, f))}
        if not self.files:
            raise FileNotFoundError(f"{self.path} has no *.safetensors weights")
        missing = [f for f in self.files if not os.path.isfile(os.path.join(self.path, f))]
        if missing:
            raise FileNotFoundError(f"{self.path}: {INDEX} names {missing[0]}, which is not there "
                                    f"({len(missing)} of {len(self.files)} files missing): the download is incomplete")
        self._names = [n for n in self._file_of if not (self.quantization and n.endswith(SCALE_SUFFIX))]
        self._headers: dict[str, dict[str, StoredTensor]] = {}
        self.stats = ReadStats()
        self.bytes = sum(os.path.getsize(os.path.join(self.path, f)) for f in self.files)
        self.progress = False           # log each file as reading it starts (one rank of a group says it)

    def stored(self, name: str) -> StoredTensor:
        file = self._file_of[name]
        if file not in self._headers:
            self._headers[file] = read_header(file)
        try:
            return self._headers[file][name]
        except KeyError:
            raise KeyError(f"{file} lacks tensor {name!r}, which {INDEX} places there") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._file_of or (self.quantization and name.endswith(SCALE_SUFFIX)):
            raise KeyError(name)
        began = time.perf_counter()
        stored = self.stored(name)
        tensor = read_tensor(stored)
        self._count(stored)
        scale = name + SCALE_SUFFIX
        if self.quantization and scale in self._file_of:
            scale_stored = self.stored(scale)
            tensor = self.quantization.dequantize(tensor, read_tensor(scale_stored))
            self._count(scale_stored)
        elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{stored.file}: {name!r} is stored in {tensor.dtype} without a {scale!r} scale; "
                             f"config.json declares no block FP8 quantization that says how to read it")
        self.stats.seconds += time.perf_counter() - began
        return tensor

    def _count(self, stored: StoredTensor) -> None:
        if stored.file not in self.stats.files:
            self.stats.files.add(stored.file)
            if self.progress and self.bytes >= PROGRESS_BYTES:
                log.info("loading %s: file %d of %d (%.1f GB), %.2f GB read in %.1f s", os.path.basename(stored.file),
                         len(self.stats.files), len(self.files), self.bytes / 1e9, self.stats.bytes / 1e9,
                         self.stats.seconds)
        self.stats.tensors += 1
        self.stats.bytes += stored.end - stored.start

    def __contains__(self, name: object) -> bool:
        return name in self._file_of and not (self.quantization and str(name).endswith(SCALE_SUFFIX))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def summary(self) -> str:
        s = self.stats
        return (f"read {s.tensors} tensors, {s.bytes / 1e9:.2f} GB from {len(s.files)} of {len(self.files)} files "
                f"in {s.seconds:.1f} s")


def unused_names(names: Iterable[str], used: set[str], num_layers: int) -> tuple[list[int], list[str]]:
    """What a load leaves out of a checkpoint: the extra decoder layers past ``num_layers`` (DeepSeek-V3's
    multi-token-prediction layer, ``model.layers.61.*``), and any other tensor no rule reads."""
    extra_layers, other = set(), []
    for name in names:
        if name in used:
            continue
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= num_layers:
            extra_layers.add(int(m.group(1)))
        else:
            other.append(name)
    return sorted(extra_layers), other


def weightless_copy(path: str, out: str) -> str:
    """``path``'s config.json (less its ``quantization_config``) and tokenizer files, without weights, in ``out``:
    what a rollout engine starts from when the checkpoint's files are not the model the actor trains (block FP8,
    which engines would serve quantized, or on CPU not at all); the first weight push gives it the dequantized
    weights the actor loaded."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(path):
        source = os.path.join(path, name)
        if name.endswith(".safetensors") or name == INDEX or not os.path.isfile(source):
            continue
        if name == "config.json":
            with open(source) as f:
                config = json.load(f)
            config.pop("quantization_config", None)
            with open(os.path.join(out, name), "w") as f:
                json.dump(config, f, indent=2)
        else:
            shutil.copy(source, os.path.join(out, name))
    return out


# --- writing ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def shard_plan(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors, at most ``max_shard_bytes`` a file (a larger tensor gets a file of its own)."""
    shards: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        if not shards or (size + spec.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _header(specs: list[TensorSpec]) -> bytes:
    header, offset = {}, 0
    for s in specs:
        header[s.name] = {"dtype": DTYPE_NAMES[s.dtype], "shape": list(s.shape), "data_offsets": [offset,
                                                                                                 offset + s.nbytes]}
        offset += s.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)            # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def write_sharded(directory: str, specs: list[TensorSpec], tensors: Iterable[tuple[str, torch.Tensor]],
                  max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` (in the order and with the shapes ``specs`` lists) as HF's sharded safetensors layout;
    returns the files written. Files are written under temporary names and renamed once complete."""
    os.makedirs(directory, exist_ok=True)
    shards = shard_plan(specs, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    stream = iter(tensors)
    for shard, name in zip(shards, names):
        partial = os.path.join(directory, name + ".partial")
        with open(partial, "wb") as f:
            f.write(_header(shard))
            for spec in shard:
                got, tensor = next(stream)
                if got != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                    raise ValueError(f"the weight stream gave {got} {tuple(tensor.shape)} {tensor.dtype} where the "
                                     f"plan has {spec.name} {spec.shape} {spec.dtype}")
                f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        os.replace(partial, os.path.join(directory, name))
    if next(stream, None) is not None:
        raise ValueError("the weight stream holds more tensors than its plan")
    for stale in os.listdir(directory):      # a previous export's files would mix into this one
        if (stale.endswith(".safetensors") or stale == INDEX) and stale not in names:
            os.remove(os.path.join(directory, stale))
    if len(shards) > 1:
        weight_map = {s.name: name for shard, name in zip(shards, names) for s in shard}
        with open(os.path.join(directory, INDEX), "w") as index:
            json.dump({"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}, index,
                      indent=2)
    return names

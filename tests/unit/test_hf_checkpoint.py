"""HF checkpoints as published, read lazily and written sharded (rlcore.hf_checkpoint), and block FP8
(rlcore.quantization): checked against safetensors' and transformers' own readers and against a dequantization
written here block by block."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlcore.hf_checkpoint import HFCheckpoint, TensorSpec, read_header, shard_plan, unused_names, write_sharded
from rlcore.quantization import BlockFP8, checkpoint_quantization

FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.f32": torch.randn(3, 5, generator=g), "b.bf16": torch.randn(7, generator=g).bfloat16(),
            "c.f16": torch.randn(2, 2, 2, generator=g).half(), "d.i64": torch.arange(6).view(2, 3),
            "e.bool": torch.tensor([True, False, True]), "f.scalar": torch.tensor(2.5),
            "g.empty": torch.empty(0, 4), "h.fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn)}


def _write_config(path, **extra) -> None:
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"num_hidden_layers": 2, **extra}, f)


def test_reader_equals_safetensors_for_every_dtype(tmp_path):
    tensors = _tensors()
    save_file(tensors, tmp_path / "model.safetensors")
    _write_config(tmp_path)
    ckpt = HFCheckpoint(str(tmp_path))
    theirs = load_file(tmp_path / "model.safetensors")
    assert sorted(ckpt) == sorted(theirs)
    for name, t in theirs.items():
        if t.dtype == torch.float8_e4m3fn:      # FP8 without a block-quantization config: refused, not guessed
            with pytest.raises(ValueError, match="h.fp8"):
                ckpt[name]
            continue
        ours = ckpt[name]
        assert ours.dtype == t.dtype and ours.shape == t.shape and torch.equal(_bytes(ours), _bytes(t)), name


def test_index_maps_tensors_to_files_and_only_those_files_are_read(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path, max_shard_size="20KB")
    with open(tmp_path / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) >= 4, files
    ckpt = HFCheckpoint(str(tmp_path))
    on_disk = {n: t for f in files for n, t in load_file(tmp_path / f).items()}
    assert sorted(ckpt) == sorted(on_disk)
    layer3 = [n for n in ckpt if n.startswith("model.layers.3.")]
    for n in layer3:
        assert torch.equal(ckpt[n], on_disk[n])
    assert ckpt.stats.files == {str(tmp_path / weight_map[n]) for n in layer3}, "read files it did not need"
    assert ckpt.stats.bytes == sum(on_disk[n].nbytes for n in layer3)
    assert ckpt.summary().startswith(f"read {len(layer3)} tensors")


def test_missing_shard_is_named(tmp_path):
    save_file({"x": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}},
                  f)
    _write_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        HFCheckpoint(str(tmp_path))


def test_sharded_writer_round_trips_and_safetensors_reads_it(tmp_path):
    tensors = {n: t for n, t in _tensors().items()}
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    (tmp_path / "model.safetensors").write_bytes(b"stale")       # a previous export's single file
    names = write_sharded(str(tmp_path), specs, tensors.items(), max_shard_bytes=40)
    assert len(names) >= 3 and not (tmp_path / "model.safetensors").exists()
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    read_back = {}
    for name in names:
        part = load_file(tmp_path / name)
        assert all(index["weight_map"][n] == name for n in part)
        read_back.update(part)
        assert min(s.start for s in read_header(str(tmp_path / name)).values()) % 8 == 0, "unaligned data"
    assert sorted(read_back) == sorted(tensors)
    for n, t in tensors.items():
        assert read_back[n].dtype == t.dtype and read_back[n].shape == t.shape and torch.equal(_bytes(read_back[n]),
                                                                                               _bytes(t)), n


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_writer_refuses_a_stream_that_leaves_its_plan(tmp_path):
    specs = [TensorSpec("a", (2,), torch.float32)]
    with pytest.raises(ValueError, match="plan has a"):
        write_sharded(str(tmp_path), specs, [("b", torch.zeros(2))], 1 << 20)
    with pytest.raises(ValueError, match="more tensors"):
        write_sharded(str(tmp_path), specs, [("a", torch.zeros(2)), ("b", torch.zeros(2))], 1 << 20)


def test_shard_plan_keeps_order_and_gives_large_tensors_their_own_file():
    specs = [TensorSpec(n, (s,), torch.float32) for n, s in [("a", 2), ("b", 2), ("big", 100), ("c", 1)]]
    assert [[s.name for s in f] for f in shard_plan(specs, 16)] == [["a", "b"], ["big"], ["c"]]


def _dequantize_block_by_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference: each block's FP8 values times that block's scale, one block at a time."""
    out = torch.empty(q.shape)
    b0, b1 = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float() \
                * scale[i, j].item()
    return out


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((256, 128), (128, 128)), ((70, 33), (16, 32)),
                                          ((5, 7), (128, 128))])
def test_block_fp8_dequantization_equals_the_block_by_block_reference(shape, block):
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-shape[0] // block[0]), -(-shape[1] // block[1]), generator=g) + 0.01
    assert torch.equal(BlockFP8(block).dequantize(q, scale), _dequantize_block_by_block(q, scale, block))
    with pytest.raises(ValueError, match="needs a scale of shape"):
        BlockFP8(block).dequantize(q, scale[:, :1].repeat(1, scale.shape[1] + 1))


def test_fp8_checkpoint_reads_dequantized_weights_and_hides_the_scales(tmp_path):
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(300, 200, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=g)
    norm = torch.randn(200, generator=g)
    save_file({"w.weight": q, "w.weight_scale_inv": scale, "n.weight": norm}, tmp_path / "model.safetensors")
    _write_config(tmp_path, quantization_config=FP8_CONFIG)
    ckpt = HFCheckpoint(str(tmp_path))
    assert sorted(ckpt) == ["n.weight", "w.weight"] and "w.weight_scale_inv" not in ckpt
    assert torch.equal(ckpt["w.weight"], _dequantize_block_by_block(q, scale, (128, 128)))
    assert torch.equal(ckpt["n.weight"], norm)


@pytest.mark.parametrize("quantization, named", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({**FP8_CONFIG, "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "no weight_block_size")])
def test_unsupported_quantization_is_refused_in_one_line(quantization, named):
    with pytest.raises(ValueError) as e:
        checkpoint_quantization({"quantization_config": quantization})
    message = str(e.value)
    assert named in message and "\n" not in message and "unquantized" in message


def test_block_fp8_config_is_read():
    assert checkpoint_quantization({"quantization_config": FP8_CONFIG}) == BlockFP8((128, 128))
    assert checkpoint_quantization({}) is None


def test_unused_names_tell_mtp_layers_from_stray_tensors():
    names = ["model.layers.0.a", "model.layers.1.a", "model.layers.2.a", "model.layers.2.eh_proj.weight",
             "lm_head.weight", "rotary.inv_freq"]
    layers, other = unused_names(names, {"model.layers.0.a", "model.layers.1.a", "lm_head.weight"}, num_layers=2)
    assert layers == [2] and other == ["rotary.inv_freq"]


def test_progress_names_each_file_of_a_large_checkpoint(tmp_path, monkeypatch, caplog):
    import logging

    import rlcore.hf_checkpoint as hf_checkpoint

    specs = [TensorSpec(f"t{i}", (64,), torch.float32) for i in range(4)]
    write_sharded(str(tmp_path), specs, ((s.name, torch.zeros(64)) for s in specs), max_shard_bytes=512)
    _write_config(tmp_path)
    ckpt = HFCheckpoint(str(tmp_path))
    ckpt.progress = True
    with caplog.at_level(logging.INFO, logger="rlcore.load"):
        ckpt["t0"]
        monkeypatch.setattr(hf_checkpoint, "PROGRESS_BYTES", 1)        # a "large" checkpoint from here on
        ckpt["t1"], ckpt["t3"]
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "loading model-00002-of-00002.safetensors"], "tiny checkpoints stay quiet; large ones name each file"

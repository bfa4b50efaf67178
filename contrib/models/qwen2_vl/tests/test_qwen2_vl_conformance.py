"""Qwen2.5-VL and Qwen2-VL against transformers, on published configs scaled down (the 3B, 7B and 72B shapes of
Qwen2.5-VL, Qwen2-VL-7B): Megatron's logits on prompts holding 1-3 images of different sizes equal transformers'
(given ``mm_token_type_ids``) at TP=1 and TP=2 (with and without sequence parallelism), HF -> Megatron -> HF is
exact, the M-RoPE positions are transformers', a packed row gives each sequence's own logits, and tokens that do
not match their images are refused."""
import pytest
import torch

from rlcore.megatron.model import read_hf_config
from rlcore.megatron.parallel import init_parallel
from rlcore.multimodal import IMAGE_INPUTS, ImageInputs
from rlcore_model_qwen2_vl.plugin import QWEN2_VL, mrope_positions
from rlcore_testing.models import (assert_round_trip_exact, assert_tp_conversion_exact, build_megatron,
                                   published_config, write_checkpoint)
from rlcore_testing.vision import (assert_image_logits_match, assert_image_logits_match_tp, image_prompts,
                                   transformers_logits)
from runs import torchrun

# head_dim stays 128, so the published mrope_section [16, 24, 24] stays; the vision ids move into the small vocabulary
TEXT = dict(hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=320, image_token_id=315, video_token_id=316, vision_start_token_id=317,
            vision_end_token_id=318, vision_token_id=319, bos_token_id=0, eos_token_id=1)
VISION_25 = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, fullatt_block_indexes=[1],
                 out_hidden_size=512)
VISION_2 = dict(depth=2, embed_dim=128, num_heads=2, hidden_size=512)
SHAPES = {"qwen2.5-vl-3b": VISION_25, "qwen2.5-vl-7b": VISION_25, "qwen2.5-vl-72b": VISION_25,
          "qwen2-vl-7b-instruct": VISION_2}
# one, three and two images per row; windowed attention sees the 12x8 image (window 112 px = 4 merged patches)
GRIDS = [[(1, 8, 8)], [(1, 4, 4), (1, 12, 8), (1, 6, 4)], [(1, 2, 8), (1, 4, 6)]]


def scaled(name: str) -> dict:
    published = published_config(name)
    return published_config(name, **TEXT, vision_config={**published["vision_config"], **SHAPES[name]})


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf_model = write_checkpoint(scaled(request.param), path)
    init_parallel(seed=0)
    model, converter = build_megatron(QWEN2_VL, path)
    return request.param, path, hf_model, model, converter


def test_logits_equal_transformers_on_image_prompts(shape):
    _, path, hf_model, model, _ = shape
    hf_config = read_hf_config(path)
    ids, images = image_prompts(hf_config, GRIDS)
    print(f"max logit difference {assert_image_logits_match(model, hf_model, hf_config, ids, images):.1e}")


def test_round_trip_is_exact_vision_tower_included(shape):
    _, path, _, model, converter = shape
    assert_round_trip_exact(model, converter, path)
    tower = [n for n, _ in model.named_parameters() if n.startswith("vision.")]
    assert tower and all(converter.rule(n).hf_names()[0] == "visual." + n[len("vision."):] for n in tower)
    assert assert_tp_conversion_exact(model, converter, path) > 0


def test_positions_are_transformers_mrope(shape):
    _, path, hf_model, model, _ = shape
    hf_config = read_hf_config(path)
    ids, images = image_prompts(hf_config, GRIDS, seed=3)
    theirs, _ = hf_model.model.get_rope_index(ids, (ids == hf_config["image_token_id"]).int(),
                                              torch.cat([i.grid_thw for i in images]))
    assert torch.equal(model.rotary_positions(ids, images), theirs)


# at TP2 in every run: the 3B shape (tied embeddings) and the 7B (also with SP); the 72B and Qwen2-VL shapes on request
# (RLCORE_ALL_LAYOUTS=1): their TP1 logits and TP-sharded conversion run every time, and TP2 adds nothing shape-specific
@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("shape", [pytest.param(name, marks=[pytest.mark.on_request] if name in (
    "qwen2.5-vl-72b", "qwen2-vl-7b-instruct") else []) for name in sorted(SHAPES)], indirect=True)
def test_logits_equal_transformers_at_tp2(shape):
    _, path, _, _, _ = shape
    diff = assert_image_logits_match_tp("qwen2_vl", "qwen2_vl", path, GRIDS, ranks=torchrun)
    print(f"max logit difference {diff:.1e}")


@pytest.mark.slow
@pytest.mark.parallel
@pytest.mark.parametrize("shape", ["qwen2.5-vl-7b"], indirect=True)   # the embeddings' gather/scatter: shape-blind
def test_logits_equal_transformers_at_tp2_with_sequence_parallelism(shape):
    _, path, _, _, _ = shape
    diff = assert_image_logits_match_tp("qwen2_vl", "qwen2_vl", path, GRIDS, sequence_parallel=True,
                                        ranks=torchrun)
    print(f"max logit difference {diff:.1e}")


@pytest.mark.parametrize("shape", ["qwen2.5-vl-7b"], indirect=True)
def test_packed_row_gives_each_sequence_its_own_logits(shape):
    """Sequences end to end in one row (pack_sequences): each token's logits equal its row's unpacked ones."""
    from rlcore.data import Batch
    from rlcore.megatron.packing import pack

    _, path, _, model, _ = shape
    ids, images = image_prompts(read_hf_config(path), GRIDS, seed=5)
    lengths = torch.tensor([40, ids.shape[1], 52])     # rows of different lengths, images within each
    packed = pack(Batch({"input_ids": ids, "prompt_len": lengths, "response_len": torch.zeros(3, dtype=torch.long)}))
    with torch.no_grad():
        rows = model(ids, None, None, images=images)
        together = model(packed.ids, None, None, images=images, packed_seq_params=packed.params)
    assert (together[0, : len(packed.rows)] - rows[packed.rows, packed.cols]).abs().max() < 1e-5


@pytest.mark.parametrize("shape", ["qwen2.5-vl-7b"], indirect=True)
def test_tokens_that_do_not_match_their_images_are_refused(shape):
    _, path, _, model, _ = shape
    hf_config = read_hf_config(path)
    ids, images = image_prompts(hf_config, [[(1, 4, 4)]])
    fewer = ImageInputs(images[0].pixel_values[:8], torch.tensor([[1, 2, 4]]))      # 2 embeddings for 4 placeholders
    with pytest.raises(ValueError, match=r"image of 2 tokens .* has no run|4 image placeholder tokens"):
        model(ids, None, None, images=[fewer])
    with pytest.raises(ValueError, match=r"the tokens hold 4 image placeholders .* the images give 0"):
        model.embed(ids, None)


def test_positions_of_text_only_sequence_are_plain():
    hf = {"vision_config": {"spatial_merge_size": 2}, "image_token_id": 9}
    positions = mrope_positions(torch.tensor([1, 2, 3, 4]), torch.zeros(0, 3, dtype=torch.long), hf)
    assert torch.equal(positions, torch.arange(4).expand(3, 4))


def test_tiny_config_builds_and_matches(tmp_path):
    """The built-in tiny Qwen2.5-VL (model.tiny, the visual task's model): head_dim 32, the note's vLLM-CPU floor."""
    hf = QWEN2_VL.tiny_hf_config(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                                 head_dim=32, ffn_hidden_size=128, max_position_embeddings=256)
    hf_model = write_checkpoint(hf, str(tmp_path))
    init_parallel(seed=0)
    model, _ = build_megatron(QWEN2_VL, str(tmp_path))
    hf_config = read_hf_config(str(tmp_path))
    ids, images = image_prompts(hf_config, [[(1, 4, 4)], [(1, 8, 4), (1, 2, 2)]])
    assert_image_logits_match(model, hf_model, hf_config, ids, images)


def image_rows_actor(tmp_path, **actor):
    """A tiny Qwen2.5-VL's checkpoint, transformers' model of it, three image rows of 4 response tokens each as the
    learner's batch, and an actor (``actor``: ActorConfig fields) on the checkpoint."""
    from rlcore.config.schema import ActorConfig
    from rlcore.data import Batch
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.model import read_hf_weights
    from rlcore.multimodal import IMAGE_INPUTS
    from rlcore_plugins.optimizers import SPECS

    hf = QWEN2_VL.tiny_hf_config(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                                 head_dim=32, ffn_hidden_size=128, max_position_embeddings=256)
    hf_model = write_checkpoint(hf, str(tmp_path))
    hf_config = read_hf_config(str(tmp_path))
    ids, images = image_prompts(hf_config, [[(1, 4, 4)], [(1, 8, 4), (1, 2, 2)], [(1, 4, 8)]])
    lengths = torch.tensor([ids.shape[1] - 3, ids.shape[1], ids.shape[1] - 1])
    mask = torch.zeros_like(ids, dtype=torch.float)
    mask[:, -8:-4] = 1.0
    batch = Batch({"input_ids": ids, "response_mask": mask, "prompt_len": lengths - 4,
                   "response_len": torch.full((3,), 4)}, [{IMAGE_INPUTS: i} for i in images])
    actor = MegatronActor(QWEN2_VL, hf_config, ActorConfig(micro_batch_size=2, **actor), SPECS[0],
                          hf_state=read_hf_weights(str(tmp_path)))
    return hf_model, hf_config, batch, lengths, actor


def moved_by_an_update(actor, batch) -> set[str]:
    """The names of the parameters one update changes."""
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    actor.train_step(batch, lambda lp, mb: (-(lp * mb["response_mask"]).sum() / 12, {}))
    return {n for n, p in actor.model.named_parameters() if not torch.equal(p, before[n])}


@pytest.mark.parametrize("pack", [False, True], ids=["rows", "packed"])
def test_actor_reads_image_rows_as_transformers_and_trains_the_tower(tmp_path, pack):
    """The learner's path: images in the batch rows' metadata reach the model through the pipeline schedule; the
    actor's logprobs equal transformers' on the same rows, and an update moves every weight, the tower's included."""
    hf_model, hf_config, batch, lengths, actor = image_rows_actor(
        tmp_path, pack_sequences=pack, max_tokens_per_micro_batch=256 if pack else 0)
    ids, images = batch["input_ids"], [m[IMAGE_INPUTS] for m in batch.meta]
    theirs = torch.log_softmax(transformers_logits(hf_model, hf_config, ids, images), -1)
    theirs = theirs.gather(-1, torch.roll(ids, -1, dims=1).unsqueeze(-1)).squeeze(-1)
    ours = actor.logprobs(batch)
    for row, length in enumerate(lengths.tolist()):
        assert (ours[row, : length - 1] - theirs[row, : length - 1]).abs().max() < 1e-5
    names = {n for n, _ in actor.model.named_parameters()}
    assert moved_by_an_update(actor, batch) == names and any(n.startswith("vision.merger.") for n in names)


@pytest.mark.parametrize("frozen", [["vision_tower"], ["projector"], ["language_model"], ["vision_tower", "projector"]])
def test_frozen_parts_keep_their_weights_and_the_others_train(tmp_path, frozen):
    """actor.freeze: one update leaves every weight of the frozen parts bit for bit as loaded and moves every other
    one (the backward pass runs through a frozen language model to the tower); Megatron DDP's gradient buffers, over
    which the distributed optimizer keeps its state, hold the others only."""
    from rlcore.model_parts import part_of

    *_, batch, _, actor = image_rows_actor(tmp_path, freeze=frozen)
    parts = {n: part_of(n, QWEN2_VL.vision) for n, _ in actor.model.named_parameters()}
    assert set(parts.values()) == {"vision_tower", "projector", "language_model"}
    assert moved_by_an_update(actor, batch) == {n for n, part in parts.items() if part not in frozen}
    buffered = {id(p) for buffer in actor.ddp.buffers for p in buffer.params}
    assert all((id(p) in buffered) == p.requires_grad == (parts[n] not in frozen)
               for n, p in actor.model.named_parameters())


def test_a_tower_tensor_no_rule_reads_fails_the_load(tmp_path):
    """A checkpoint whose tower holds a tensor the config's tower lacks (a renamed or deeper tower) is refused,
    rather than trained with that weight left out."""
    import json

    from safetensors.torch import save_file

    hf = QWEN2_VL.tiny_hf_config(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                                 head_dim=32, ffn_hidden_size=128, max_position_embeddings=256)
    write_checkpoint(hf, str(tmp_path))
    save_file({"visual.blocks.2.norm1.weight": torch.ones(64)}, str(tmp_path / "extra.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["visual.blocks.2.norm1.weight"] = "extra.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    init_parallel(seed=0)
    with pytest.raises(ValueError, match=r"1 vision tower tensor\(s\) no weight rule reads, e.g. "
                                         r"visual.blocks.2.norm1.weight"):
        build_megatron(QWEN2_VL, str(tmp_path))


@pytest.mark.parametrize("name", ["qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-72b"])
def test_dry_run_counts_the_published_models_parameters(name):
    """--dry-run's count (language model and vision tower, the tower whole on each TP rank of the first stage)
    against transformers' model of the published config, built on the meta device."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from rlcore.config import load_config
    from rlcore.megatron.model import transformer_config
    from rlcore.megatron.vision import tower_parameters
    from rlcore.sizing import estimate, read_model_config

    cfg = load_config("quickstart", ["model.family=qwen2_vl", f"model.hf_config={name}", "trainer.world_size=8",
                                     "actor.parallel.tp=4"])
    hf = read_model_config(cfg)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model(**published_config(name)))
    theirs = sum(p.numel() for p in model.parameters())
    tower = tower_parameters(QWEN2_VL.vision, hf)
    assert tower == sum(p.numel() for p in model.model.visual.parameters())
    counted = estimate(transformer_config(QWEN2_VL, hf), hf, cfg, tower=tower)
    assert abs(counted["total_params"] - theirs) / theirs < 1e-3, (counted["total_params"], theirs)
    language = estimate(transformer_config(QWEN2_VL, hf), hf, cfg)["per_device"]["params"]
    assert counted["per_device"]["params"] - language == tower * 4       # fp32: the whole tower on the TP rank
    # actor.freeze=[vision_tower]: its weights stay, without gradients (fp32) or optimizer state; the projector trains
    projector = tower_parameters(QWEN2_VL.vision, hf, "projector")
    assert projector == sum(p.numel() for p in model.model.visual.merger.parameters())
    frozen = load_config("quickstart", ["model.family=qwen2_vl", f"model.hf_config={name}", "trainer.world_size=8",
                                        "actor.parallel.tp=4", "actor.freeze=[vision_tower]"])
    kept = estimate(transformer_config(QWEN2_VL, hf), hf, frozen, tower=tower, projector=projector)["per_device"]
    assert counted["per_device"]["grads"] - kept["grads"] == (tower - projector) * 4
    assert kept["params"] == counted["per_device"]["params"] and kept["optimizer"] < counted["per_device"]["optimizer"]

"""Conformance checks for vision-language model plugins (Qwen2-VL / Qwen2.5-VL), on tiny random checkpoints built
in-process (fp32, CPU, gloo), against transformers' own model given ``mm_token_type_ids`` (without them it builds
wrong M-RoPE positions: ../shared/notes/vlm-rl.md):

- ``image_prompts``: rows of one length, each holding images of the given patch grids between the family's vision
  start/end tokens and random text, with random pixel values (the processor is not what is checked here);
- ``assert_image_logits_match``: megatron-core's logits equal transformers' on them;
- ``assert_image_logits_match_tp``: the same at TP=2 (with and without sequence parallelism) in two processes.
"""
from __future__ import annotations

import os
import re
import textwrap

import torch

from rlcore.multimodal import ImageInputs
from rlcore_testing.models import RankRunner, torchrun_ranks

# fp32 logits of a tiny vision-language model agree to ~1e-6 when the mapping is right; the bound is 1e-5
IMAGE_LOGIT_TOLERANCE = 1e-5


def image_prompts(hf_config: dict, grids: list[list[tuple[int, int, int]]], text: int = 6, seed: int = 0,
                  multiple: int = 1) -> tuple[torch.Tensor, list[ImageInputs]]:
    """One row per entry of ``grids`` (each a list of (t, h, w) patch grids): ``text`` random tokens, then per
    image vision-start, its placeholders, vision-end and ``text`` random tokens; rows padded with random text to one
    length, a multiple of ``multiple``. Returns the ids [rows, length] and each row's images."""
    g = torch.Generator().manual_seed(seed)
    vision = hf_config["vision_config"]
    merge, patch, temporal = vision["spatial_merge_size"], vision["patch_size"], vision["temporal_patch_size"]
    features = vision.get("in_chans", vision.get("in_channels", 3)) * temporal * patch * patch
    special = {hf_config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                      "vision_end_token_id")}
    words = torch.tensor([i for i in range(hf_config["vocab_size"]) if i not in special])

    def random_text(n: int) -> list[int]:
        return words[torch.randint(0, len(words), (n,), generator=g)].tolist()

    rows, images = [], []
    for row in grids:
        ids = random_text(text)
        for t, h, w in row:
            ids += [hf_config["vision_start_token_id"], *[hf_config["image_token_id"]] * (t * h * w // merge ** 2),
                    hf_config["vision_end_token_id"], *random_text(text)]
        rows.append(ids)
        grid = torch.tensor(row, dtype=torch.long).reshape(-1, 3)
        images.append(ImageInputs(torch.randn(int(grid.prod(-1).sum()), features, generator=g), grid))
    width = -(-max(map(len, rows)) // multiple) * multiple
    return torch.tensor([r + random_text(width - len(r)) for r in rows]), images


def transformers_logits(hf_model, hf_config: dict, ids: torch.Tensor, images: list[ImageInputs]) -> torch.Tensor:
    """transformers' logits with the images and ``mm_token_type_ids`` (1 at image placeholders)."""
    with torch.no_grad():
        return hf_model(input_ids=ids, pixel_values=torch.cat([i.pixel_values for i in images]),
                        image_grid_thw=torch.cat([i.grid_thw for i in images]),
                        mm_token_type_ids=(ids == hf_config["image_token_id"]).int()).logits


def assert_image_logits_match(model, hf_model, hf_config: dict, ids: torch.Tensor, images: list[ImageInputs],
                              tolerance: float = IMAGE_LOGIT_TOLERANCE) -> float:
    with torch.no_grad():
        ours = model(ids, None, None, images=images)
    theirs = transformers_logits(hf_model, hf_config, ids, images)
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    diff = (ours - theirs).abs().max().item()
    assert diff < tolerance, f"Megatron logits differ from transformers' on image prompts by {diff}"
    return diff


def write_vision_model_dir(hf_config: dict, path: str, seed: int = 0):
    """A servable tiny Qwen2.5-VL directory: the checkpoint (``hf_config`` as from the plugin's tiny_hf_config: the
    vision tokens are the vocabulary's last four ids), a one-word-per-id tokenizer (``t<id>``) with a chat template
    that joins the messages' contents, and the plugin's own tiny files (its vision tokens, its image processor).
    Returns transformers' model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlcore_model_qwen2_vl.plugin import VISION_TOKENS, tiny_files
    from rlcore_testing.models import write_checkpoint

    model = write_checkpoint(hf_config, path, seed)
    words = [f"t{i}" for i in range(hf_config["vocab_size"] - len(VISION_TOKENS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = words[hf_config["eos_token_id"]]
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos,
                                        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert tiny_files(path, tokenizer) == hf_config["vocab_size"]
    return model


def random_images(sizes: list[tuple[int, int]], seed: int = 0) -> list:
    """PIL images of random pixels, (height, width) each."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def served_image_checks(path: str) -> dict:
    """In this process (a fresh one: vLLM allows one in-process engine per process): a tiny Qwen2.5-VL written to
    ``path``, served by vLLM, checked in order against transformers. Returns what was measured: the largest
    teacher-forced logprob gap on one- and two-image prompts before and after a push that changes the vision tower,
    the prompt token-in and vLLM's text path give, and what 8 x 16 samples of a uniform model hold, free and with
    the vision tokens banned."""
    import asyncio

    from transformers import AutoProcessor
    from vllm import SamplingParams

    from rlcore.config.schema import RolloutConfig
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore.plugins import load_plugins
    from rlcore.specs import Sampling

    torch.set_num_threads(1)
    spec = load_plugins(["qwen2_vl"]).registry.get("models", "qwen2_vl")
    reference = write_vision_model_dir(spec.tiny_hf_config(
        vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, ffn_hidden_size=128,
        max_position_embeddings=256), path)
    hf_config, processor = read_hf_config(path), AutoProcessor.from_pretrained(path)
    backend = load_plugins(["vllm"]).registry.get("rollout_backends", "vllm")
    engine = backend.factory(path, RolloutConfig(kv_cache_gib=0.05, limit_images=2), seed=0, max_model_len=256)

    def prompt(images: list, text: list[int]) -> tuple[list[int], ImageInputs]:
        pixels = processor.image_processor(images=images, return_tensors="pt")
        ids = list(text)
        for grid in pixels["image_grid_thw"].tolist():
            ids += spec.vision.image_tokens(grid, hf_config) + [5]
        return ids, ImageInputs(pixels["pixel_values"], pixels["image_grid_thw"])

    def worst_gap() -> float:
        worst = 0.0
        for sizes, text in (([(84, 84)], [3, 4]), ([(56, 112), (112, 84)], [7])):
            images = random_images(sizes, seed=len(sizes))
            ids, inputs = prompt(images, text)
            sequence = ids + [11, 12, 13, 14]
            ours = engine.score_with_images([sequence], [len(ids)], [images])[0]
            logp = torch.log_softmax(transformers_logits(reference, hf_config, torch.tensor([sequence]),
                                                         [inputs])[0].double(), -1)
            theirs = [logp[j - 1, sequence[j]].item() for j in range(len(ids), len(sequence))]
            worst = max(worst, max(abs(a - b) for a, b in zip(ours, theirs)))
        return worst

    try:
        measured: dict = {"gap_before": worst_gap()}
        images = random_images([(84, 84), (56, 112)], seed=3)
        ids, _ = prompt(images, [3, 4])
        one_each = engine._image_prompts([ids], [images])[0]["prompt_token_ids"]
        text = " ".join(processor.tokenizer.convert_ids_to_tokens(one_each))
        out = engine.llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                                  SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)[0]
        measured.update(token_in_prompt=ids, text_path_prompt=list(out.prompt_token_ids))
        g = torch.Generator().manual_seed(7)
        tower = {n: t + torch.randn(t.shape, generator=g) * 0.05 for n, t in read_hf_weights(path).items()
                 if n.startswith("visual.")}
        engine.update_weights(iter(tower.items()), version=1)
        reference.model.visual.load_state_dict({n[len("visual."):]: t for n, t in tower.items()}, strict=True)
        measured["gap_after"] = worst_gap()
        engine.update_weights(iter([("model.norm.weight", torch.zeros(64))]), version=2)   # every token alike
        images = random_images([(84, 84)], seed=4)
        ids, _ = prompt(images, [3])

        async def sample(banned: tuple[int, ...]) -> list[int]:
            done = await asyncio.gather(*(engine.generate_with_images(
                ids, images, Sampling(16, min_tokens=16, banned_token_ids=banned), seed, f"r{seed}-{len(banned)}")
                for seed in range(8)))
            return [t for c in done for t in c.tokens]

        measured["sampled_free"] = asyncio.run(sample(()))
        measured["sampled_banned"] = asyncio.run(sample(spec.vision.reserved_token_ids(hf_config)))
        return measured
    finally:
        engine.stop()


_TP_RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    torch.set_num_threads(1)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from rlcore.megatron.model import build_gpt, load_hf_into, read_hf_config, read_hf_weights
    from rlcore.megatron.parallel import init_parallel, shutdown_parallel
    from rlcore.plugins import load_plugins
    from rlcore_testing.models import auto_model_class
    from rlcore_testing.vision import image_prompts, transformers_logits
    plugin, family, path, grids, sp = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5] == "1"
    spec = load_plugins([plugin]).registry.get("models", family)
    init_parallel(tp=2, seed=0)
    hf_config = read_hf_config(path)
    model, converter = build_gpt(spec, hf_config, sequence_parallel=sp)
    load_hf_into(model, converter, read_hf_weights(path))
    ids, images = image_prompts(hf_config, [[tuple(g) for g in row] for row in grids], multiple=2)
    with torch.no_grad():
        ours = gather_from_tensor_model_parallel_region(model.eval()(ids, None, None, images=images))
    hf_model = auto_model_class(hf_config).from_pretrained(path, dtype=torch.float32).eval()
    diff = (ours - transformers_logits(hf_model, hf_config, ids, images)).abs().max().item()
    rank = dist.get_rank()
    shutdown_parallel()
    print(f"TP2 diff {diff:.3e} rank {rank}", flush=True)   # one write: two ranks share the pipe
""")


def assert_image_logits_match_tp(plugin: str, family: str, path: str, grids: list[list[tuple[int, int, int]]],
                                 sequence_parallel: bool = False, tolerance: float = IMAGE_LOGIT_TOLERANCE,
                                 ranks: RankRunner = torchrun_ranks) -> float:
    """Two processes at TP=2 (the language model split, the vision tower whole on both): logits equal
    transformers'. Returns the largest difference. ``ranks``: what starts them (default: torchrun)."""
    import json

    script = os.path.join(path, "_tp2_rank.py")
    with open(script, "w") as f:
        f.write(_TP_RANK)
    result = ranks(2, script, plugin, family, path, json.dumps(grids), "1" if sequence_parallel else "0")
    diffs = [float(d) for d in re.findall(r"TP2 diff (\S+) rank", result.stdout)]   # the ranks' lines may interleave
    assert result.returncode == 0 and len(diffs) == 2, result.stderr[-4000:]
    assert max(diffs) < tolerance, f"at TP=2 Megatron logits differ from transformers' by {max(diffs)}"
    return max(diffs)

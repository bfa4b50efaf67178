"""The visual task's rollout and update against the same model on text-only prompts of the same length: what images
cost per token (issue 41's benchmark).

    python bench/visual_tokens.py [--prompts 64] [--image-size 112] [--response 8] [--repeats 3] [--smoke]

The visual-quickstart's tiny Qwen2.5-VL architecture (random weights; its tokenizer and image processor as the run
builds them) and the shapes task's grid-scene prompts ("<image> count red", one image of ``--image-size`` pixels a
side). The text-only twin of each prompt has the same tokens with every image placeholder replaced by a word, and no
image. Rollout: the vLLM engine (in this process) samples ``--response`` tokens for every prompt, all in flight at
once (``generate_with_images`` vs ``generate``); update: the Megatron actor's ``train_step`` on the prompts and their
responses (the images' pixels in the rows' metadata vs none). Prints tokens/s (prompt + response) of each, median of
``--repeats`` after a warm-up. Last line: ``visual/text-only tokens/s: rollout <x>x, update <y>x (<n> prompts, <t>
tokens each)``. ``--smoke`` (tests/integration/test_bench_smoke.py): 4 prompts, 2 tokens, one repeat.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time


def timed(fn, repeats: int) -> float:
    fn()                            # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--response", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.response, args.repeats = 4, 2, 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from rlcore.config import load_config
    from rlcore.data import Batch, build_sequences
    from rlcore.megatron.actor import MegatronActor
    from rlcore.megatron.model import read_hf_config, read_hf_weights
    from rlcore.multimodal import IMAGE_INPUTS, IMAGES, ImagePrompts
    from rlcore.plugins import load_plugins
    from rlcore.specs import Sampling

    torch.set_num_threads(1)
    cfg = load_config("visual-quickstart", [f"task.options.image_size={args.image_size}", "task.options.scene=grid",
                                            "rollout.kv_cache_gib=0.1"])
    registry = load_plugins(["qwen2_vl", "grpo", "vllm"]).registry
    spec, task = registry.get("models", "qwen2_vl"), registry.get("tasks", "shapes").build(
        dict(cfg.task.options), 0)
    with tempfile.TemporaryDirectory() as path:
        task.write_tokenizer(path)
        vocab = spec.vision.tiny_files(path, AutoTokenizer.from_pretrained(path))
        hf = spec.tiny_hf_config(vocab_size=vocab, **dataclasses.asdict(cfg.model.tiny))
        torch.manual_seed(0)
        AutoModelForImageTextToText.from_config(AutoConfig.for_model(**hf)).float().save_pretrained(path)
        hf_config, tokenizer = read_hf_config(path), AutoTokenizer.from_pretrained(path)
        images = ImagePrompts(path, spec.vision, hf_config, tokenizer, 1)
        rows = [images.encode(p, m[IMAGES], "bench") for p, m in task.train_prompts(0, args.prompts)]
        word = tokenizer.convert_tokens_to_ids("count")
        twins = [[word if t in images.reserved else t for t in tokens] for tokens, _, _ in rows]
        length = len(rows[0][0]) + args.response

        engine = registry.get("rollout_backends", "vllm").factory(path, cfg.rollout, seed=0, max_model_len=64)
        sampling = Sampling(args.response, min_tokens=args.response, banned_token_ids=images.reserved)

        def rollout(visual: bool):
            async def all_at_once():
                return await asyncio.gather(*(
                    engine.generate_with_images(tokens, pil, sampling, i, f"v{i}") if visual else
                    engine.generate(twins[i], sampling, i, f"t{i}") for i, (tokens, pil, _) in enumerate(rows)))
            return asyncio.run(all_at_once())

        rollout_s = {kind: timed(lambda: rollout(kind == "visual"), args.repeats) for kind in ("visual", "text")}
        responses = [c.tokens for c in rollout(True)]
        engine.stop()

        actor = MegatronActor(spec, hf_config, cfg.actor, registry.get("optimizers", cfg.actor.optim.name),
                              hf_state=read_hf_weights(path))

        def update(visual: bool):
            prompts = [tokens for tokens, _, _ in rows] if visual else twins
            batch = Batch(build_sequences(prompts, responses, tokenizer.eos_token_id),
                          [{IMAGE_INPUTS: pixels} for _, _, pixels in rows] if visual else [])
            actor.train_step(batch, lambda logp, mb: (-(logp * mb["response_mask"]).sum() / logp.numel(), {}))

        update_s = {kind: timed(lambda: update(kind == "visual"), args.repeats) for kind in ("visual", "text")}
    tokens = args.prompts * length
    for phase, seconds in (("rollout", rollout_s), ("update", update_s)):
        print(f"{phase:8s} visual {tokens / seconds['visual']:.0f} tokens/s, text-only {tokens / seconds['text']:.0f} "
              f"tokens/s (median of {args.repeats})")
    print(f"visual/text-only tokens/s: rollout {rollout_s['text'] / rollout_s['visual']:.2f}x, update "
          f"{update_s['text'] / update_s['visual']:.2f}x ({args.prompts} prompts, {length} tokens each)")


if __name__ == "__main__":
    sys.exit(main())

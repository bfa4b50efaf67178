"""A tiny Qwen2.5-VL served by vLLM (its CPU build) against transformers (fp32): image prompts reach the engine
token-in with the trained model's tokens (each image's run of placeholders, which the backend hands vLLM as one) and
the images; the prompt vLLM builds is the one its own text path builds; logprobs agree before and after a weight push
that changes the vision tower (whose cached image embeddings the push must drop); a banned placeholder is never
sampled, where an unbanned one is. The tests share one engine and run in order (the last one spoils its weights)."""
import asyncio

import pytest
import torch

from rlcore.megatron.model import read_hf_config, read_hf_weights
from rlcore.specs import Sampling
from rlcore_model_qwen2_vl.plugin import QWEN2_VL
from rlcore.config.schema import RolloutConfig
from rlcore.plugins import load_plugins
from rlcore_testing.vision import random_images, transformers_logits, write_vision_model_dir
from rlcore.multimodal import ImageInputs

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4


class Served:
    def __init__(self, path: str):
        self.path, self.reference = path, write_vision_model_dir(self.hf_config_raw(), path)
        self.hf_config = read_hf_config(path)
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        spec = load_plugins(["vllm"]).registry.get("rollout_backends", "vllm")
        self.engine = spec.factory(path, RolloutConfig(kv_cache_gib=0.05, limit_images=2), seed=0, max_model_len=256)

    @staticmethod
    def hf_config_raw() -> dict:
        return QWEN2_VL.tiny_hf_config(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                                       head_dim=32, ffn_hidden_size=128, max_position_embeddings=256)

    def prompt(self, images: list, text: list[int]) -> tuple[list[int], ImageInputs]:
        """The trained model's tokens for ``text`` then each image (vision start, its placeholders, vision end)."""
        pixels = self.processor.image_processor(images=images, return_tensors="pt")
        ids, merge = list(text), self.hf_config["vision_config"]["spatial_merge_size"]
        for t, h, w in pixels["image_grid_thw"].tolist():
            ids += [self.hf_config["vision_start_token_id"], *[self.hf_config["image_token_id"]] * (t * h * w //
                    merge ** 2), self.hf_config["vision_end_token_id"], 5]
        return ids, ImageInputs(pixels["pixel_values"], pixels["image_grid_thw"])

    def worst_gap(self) -> float:
        """The engine's teacher-forced logprobs of a continuation after image prompts vs transformers'."""
        worst = 0.0
        for sizes, text in (([(84, 84)], [3, 4]), ([(56, 112), (112, 84)], [7])):
            images = random_images(sizes, seed=len(sizes))
            prompt, inputs = self.prompt(images, text)
            sequence = prompt + [11, 12, 13, 14]
            ours = self.engine.score_with_images([sequence], [len(prompt)], [images])[0]
            ids = torch.tensor([sequence])
            logp = torch.log_softmax(transformers_logits(self.reference, self.hf_config, ids, [inputs])[0].double(), -1)
            theirs = [logp[j - 1, sequence[j]].item() for j in range(len(prompt), len(sequence))]
            worst = max(worst, max(abs(a - b) for a, b in zip(ours, theirs)))
        return worst


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = Served(str(tmp_path_factory.mktemp("vl")))
    yield s
    s.engine.stop()


def test_engine_logprobs_on_image_prompts_equal_transformers(served):
    gap = served.worst_gap()
    print(f"max |engine - transformers| logprob {gap:.1e}")
    assert gap < TOLERANCE


def test_token_in_prompt_is_the_text_paths_prompt(served):
    """vLLM's own processing of the text with one placeholder per image expands it to the trained model's tokens."""
    from vllm import SamplingParams

    images = random_images([(84, 84), (56, 112)], seed=3)
    prompt, _ = served.prompt(images, [3, 4])
    words = served.processor.tokenizer.convert_ids_to_tokens(served.engine._image_prompts([prompt], [images])[0]
                                                             ["prompt_token_ids"])
    out = served.engine.llm.generate({"prompt": " ".join(words), "multi_modal_data": {"image": images}},
                                     SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt


def test_weight_push_that_changes_the_vision_tower(served):
    """The push drops the engine's cached image embeddings: the images scored before are scored with the new tower."""
    g = torch.Generator().manual_seed(7)
    tower = {n: t + torch.randn(t.shape, generator=g) * 0.05 for n, t in read_hf_weights(served.path).items()
             if n.startswith("visual.")}
    served.engine.update_weights(iter(tower.items()), version=1)
    missing = served.reference.model.visual.load_state_dict({n[len("visual."):]: t for n, t in tower.items()},
                                                            strict=True)
    assert not missing.missing_keys
    gap = served.worst_gap()
    print(f"after the push: max |engine - transformers| logprob {gap:.1e}")
    assert gap < TOLERANCE


def test_a_banned_placeholder_is_never_sampled(served):
    """Weights whose final norm is zero make every next token equally likely: sampled freely, the four vision
    tokens (of 64) show up; banned, never."""
    served.engine.update_weights(iter([("model.norm.weight", torch.zeros(64))]), version=2)
    images = random_images([(84, 84)], seed=4)
    prompt, _ = served.prompt(images, [3])
    vision = tuple(range(60, 64))

    async def sample(banned):
        return await asyncio.gather(*(served.engine.generate_with_images(
            prompt, images, Sampling(16, min_tokens=16, banned_token_ids=banned), seed, f"r{seed}-{len(banned)}")
            for seed in range(8)))

    free = [t for c in asyncio.run(sample(())) for t in c.tokens]
    banned = [t for c in asyncio.run(sample(vision)) for t in c.tokens]
    assert any(t in vision for t in free) and len(banned) == 8 * 16
    assert not any(t in vision for t in banned)

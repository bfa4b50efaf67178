"""`rlcore run` on image prompts: a tiny Qwen2.5-VL with its processor, a JSONL dataset whose rows hold an image path
and an <image> tag, three GRPO steps colocated and asynchronous, the engine checked against the actor after every
push on text and image prompts. And the bad inputs a user meets first, each refused in one line naming it."""
import json
import os
import subprocess
import sys

import pytest

from rlcore.config import load_config
from rlcore.errors import RlcoreError
from rlcore.multimodal import IMAGES, ImagePrompts
from rlcore.rollout.source import Source
from rlcore_model_qwen2_vl.plugin import QWEN2_VL
from rlcore_testing.vision import random_images, write_vision_model_dir

TINY = dict(vocab_size=64, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32, ffn_hidden_size=128,
            max_position_embeddings=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vl") / "model"
    write_vision_model_dir(QWEN2_VL.tiny_hf_config(**TINY), str(path))
    return path


def image_rows(root, count: int = 16) -> str:
    """JSONL rows: "t<i> <image> t<j>" with a PNG of one of three sizes, scored by exact match against "t<k>"."""
    rows = []
    for i, image in enumerate(random_images([(56 + 28 * (i % 3), 84) for i in range(count)], seed=1)):
        image.save(root / f"img{i}.png")
        rows.append({"prompt": f"t{i % 7} <image> t{i % 5}", "images": [str(root / f"img{i}.png")],
                     "reward_model": {"ground_truth": f"t{i % 3}"}, "data_source": "rlcore/addition"})
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run(model_dir, train_file: str, run_dir, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen2_vl,grpo,vllm", "quickstart",
         "model.family=qwen2_vl", f"model.path={model_dir}", "task.name=dataset",
         f"task.options.train_files=[{train_file}]", "task.options.chat_template=false", "trainer.steps=3",
         "trainer.eval_every=0", "trainer.check_logprobs_every=1", "run.progress=false", "trainer.export_hf=false",
         "trainer.loggers=[jsonl]", f"run.dir={run_dir}", *overrides],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_image_prompts_train_and_the_engine_agrees_after_every_push(model_dir, tmp_path, mode):
    result = run(model_dir, image_rows(tmp_path), tmp_path / "run", f"trainer.mode={mode}")
    assert result.returncode == 0, result.stderr[-4000:]
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(h["check/logprob_max_diff"] < 1e-4 for h in history), [h["check/logprob_max_diff"] for h in history]
    assert any(h["actor/grad_norm"] > 0 for h in history)


@pytest.mark.slow
@pytest.mark.e2e
def test_an_image_that_cannot_be_decoded_stops_the_run_in_one_line(model_dir, tmp_path):
    train = image_rows(tmp_path, count=4)
    (tmp_path / "img2.png").write_bytes(b"not a picture")
    result = run(model_dir, train, tmp_path / "run")
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "the image cannot be decoded" in last and "prompt 't2 <image> t2'" in last, last


class Encoder(Source):
    """Only what encodes prompts: a source's encode_prompt, without engines."""
    def episodes(self, *a): raise AssertionError
    def sync(self): raise AssertionError
    def next_groups(self, *a): raise AssertionError
    def push_weights(self, *a): raise AssertionError


def encoder(model_dir, *overrides: str) -> Encoder:
    from transformers import AutoTokenizer

    from rlcore.megatron.model import read_hf_config

    cfg = load_config("quickstart", ["model.family=qwen2_vl", *overrides])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    images = ImagePrompts(str(model_dir), QWEN2_VL.vision, read_hf_config(str(model_dir)), tokenizer,
                          cfg.rollout.limit_images)
    return Encoder(cfg, None, tokenizer, 256, None, lambda r: True, images=images)


def test_prompt_tokens_hold_each_image_as_the_model_reads_it(model_dir):
    source = encoder(model_dir, "rollout.limit_images=2")
    images = random_images([(56, 84), (112, 56)])
    tokens, meta = source.encode_prompt("t1 <image> t2 <image>", {IMAGES: images, "answer": "t3"})
    grids = meta["image_inputs"].grid_thw.tolist()
    assert grids == [[1, 4, 6], [1, 8, 4]]
    assert tokens == [1, 62, *[60] * 6, 63, 2, 62, *[60] * 8, 63]
    assert meta["answer"] == "t3" and all(i.mode == "RGB" for i in meta[IMAGES])
    assert source.sampling(1.0).banned_token_ids == (60, 61, 62, 63)


@pytest.mark.parametrize("prompt, images, overrides, message", [
    ("t1 <image>", 2, [], r"holds 1 <image> tag\(s\) for 2 image\(s\)"),
    ("<image> <image>", 2, [], r"2 images, more than rollout.limit_images=1"),
    # one text token and a 250-token response would fit the 256-token context; the image's six tokens do not
    ("t1 <image>", 1, ["rollout.max_response_len=250"],
     r"has 7 tokens \(its images' included\); with rollout.max_response_len 250 it exceeds the model's context"),
])
def test_bad_image_prompts_are_refused_in_one_line(model_dir, prompt, images, overrides, message):
    source = encoder(model_dir, *overrides)
    with pytest.raises(RlcoreError, match=message) as refused:
        source.encode_prompt(prompt, {IMAGES: random_images([(56, 56)] * images)})
    assert "\n" not in str(refused.value)


def test_images_for_a_text_only_model_are_refused(model_dir):
    source = encoder(model_dir)
    source.images = None
    with pytest.raises(RlcoreError, match=r"holds 1 image\(s\) but model.family 'qwen2_vl'|text-only model"):
        source.encode_prompt("<image>", {IMAGES: random_images([(56, 56)])})

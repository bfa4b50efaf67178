"""`rlcore run` on image prompts: a tiny Qwen2.5-VL with its processor, a JSONL dataset whose rows hold an image path
and an <image> tag, three GRPO steps colocated and asynchronous, the engine checked against the actor after every
push on text and image prompts. And the bad inputs a user meets first, each refused in one line naming it."""
import json
import subprocess
import sys

import pytest
import torch
from runs import ENV, logged, run_cli

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
    return run_cli(
        [sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen2_vl,grpo,vllm", "quickstart",
         "model.family=qwen2_vl", f"model.path={model_dir}", "task.name=dataset",
         f"task.options.train_files=[{train_file}]", "task.options.chat_template=false", "trainer.steps=3",
         "trainer.eval_every=0", "trainer.check_logprobs_every=1", "run.progress=false", "trainer.export_hf=false",
         "trainer.loggers=[jsonl]", f"run.dir={run_dir}", *overrides],
        env=ENV)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["colocated", "async"])
def test_image_prompts_train_and_the_engine_agrees_after_every_push(model_dir, tmp_path, mode):
    result = run(model_dir, image_rows(tmp_path), tmp_path / "run", f"trainer.mode={mode}", "trainer.export_hf=true")
    assert result.returncode == 0, result.stderr[-4000:]
    exported = tmp_path / "run" / "hf"       # the trained model with the processor it read its images with
    assert (exported / "processor_config.json").read_text() == (model_dir / "processor_config.json").read_text()
    history = logged(tmp_path / "run")
    assert [h["step"] for h in history] == [1, 2, 3]
    assert all(h["check/logprob_max_diff"] < 1e-4 for h in history), [h["check/logprob_max_diff"] for h in history]
    assert any(h["actor/grad_norm"] > 0 for h in history)
    # every push sends every tensor of the checkpoint, the tower's included, and nothing else
    checkpoint = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    pushed = {h["sync/tensors"] for h in history if "sync/tensors" in h}
    assert pushed == {len(checkpoint)} and any(n.startswith("visual.") for n in checkpoint), (pushed, len(checkpoint))


@pytest.mark.slow
@pytest.mark.e2e
def test_a_frozen_vision_tower_is_served_and_exported_as_loaded(model_dir, tmp_path):
    """actor.freeze=[vision_tower]: the engine still agrees with the actor after every push, and the exported model
    holds the tower's weights bit for bit as loaded, while the projector and the language model trained."""
    from rlcore.megatron.model import read_hf_weights

    result = run(model_dir, image_rows(tmp_path), tmp_path / "run", "actor.freeze=[vision_tower]",
                 "trainer.export_hf=true")
    assert result.returncode == 0, result.stderr[-4000:]
    history = logged(tmp_path / "run")
    assert all(h["check/logprob_max_diff"] < 1e-4 for h in history), [h["check/logprob_max_diff"] for h in history]
    loaded, trained = read_hf_weights(str(model_dir)), read_hf_weights(str(tmp_path / "run" / "hf"))
    assert loaded.keys() == trained.keys()
    same = {name for name in loaded if torch.equal(loaded[name], trained[name])}
    tower = {name for name in loaded if name.startswith("visual.") and not name.startswith("visual.merger.")}
    assert same == tower, (sorted(same - tower)[:3], sorted(tower - same)[:3])


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("sync", ["merged", "adapters"])
def test_lora_on_the_language_model_is_checked_after_every_push_and_loads_in_peft(model_dir, tmp_path, sync):
    """LoRA on a vision-language model (the tower frozen with the base): the engine agrees with the actor after every
    push, the adapters merged or sent alone (vLLM's LoRA); the run's PEFT adapter, which names transformers' modules
    (model.language_model.*, not the checkpoint's model.*), loads onto transformers' model of the base with
    ``PeftModel.from_pretrained``, and its merge_and_unload equals the run's merged export exactly."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from rlcore.megatron.model import read_hf_weights

    result = run(model_dir, image_rows(tmp_path), tmp_path / "run", "actor.lora.rank=8", "actor.lora.alpha=16",
                 "actor.optim.lr=0.001", f"rollout.lora={sync}", "trainer.steps=4", "trainer.export_hf=true")
    assert result.returncode == 0, result.stderr[-4000:]
    history = logged(tmp_path / "run")
    assert all(h["check/logprob_max_diff"] < 1e-4 for h in history), [h["check/logprob_max_diff"] for h in history]
    assert any(h["actor/grad_norm"] > 0 for h in history[:-1])      # a later push carried trained adapters
    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").merge_and_unload().state_dict()
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "run" / "hf", dtype=torch.float32).state_dict()
    assert merged.keys() == exported.keys() and all(torch.equal(merged[k], exported[k]) for k in merged)
    loaded, trained = read_hf_weights(str(model_dir)), read_hf_weights(str(tmp_path / "run" / "hf"))
    changed = {name for name in loaded if not torch.equal(loaded[name], trained[name])}
    assert changed and not any(name.startswith("visual.") for name in changed), sorted(changed)[:3]


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
     r"has 7 tokens \(its images included\); with rollout.max_response_len 250 it exceeds the model's context"),
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


GEO3K_INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
                     r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer "
                     r"MUST BE put in \boxed{}.")


def geo3k_parquet(path, count: int = 8) -> str:
    """Rows as verl's examples/data_preprocess/geo3k.py makes them from hiyouga/geometry3k and HF datasets writes
    them: chat messages whose content starts with the dataset's <image> tag, `images` a list of {bytes, path}
    structs (an `Image` feature, PNG bytes embedded), the ground truth under reward_model, the datasets schema
    metadata beside it."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for i, image in enumerate(random_images([(84, 112)] * count, seed=5)):
        png = io.BytesIO()
        image.save(png, format="PNG")
        problem, answer = f"<image>Find x. Round to the nearest tenth if necessary. t{i}", str(i + 1)
        rows.append({"data_source": "hiyouga/geometry3k",
                     "prompt": [{"role": "user", "content": problem + " " + GEO3K_INSTRUCTION}],
                     "images": [{"bytes": png.getvalue(), "path": None}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": answer},
                     "extra_info": {"split": "train", "index": i, "answer": answer, "question": problem}})
    image_struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("data_source", pa.string()),
                        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("images", pa.list_(image_struct)), ("ability", pa.string()),
                        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
                        ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()),
                                                  ("answer", pa.string()), ("question", pa.string())]))])
    features = {"data_source": {"dtype": "string", "_type": "Value"},
                "images": {"feature": {"_type": "Image"}, "_type": "Sequence"}}
    schema = schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


@pytest.mark.slow
@pytest.mark.e2e
def test_verl_geo3k_parquet_trains(model_dir, tmp_path):
    """verl's geometry3k Parquet as is: images as embedded bytes structs, rows scored by the geo3k reward of their
    data source (0.9 accuracy + 0.1 format, both logged)."""
    result = run(model_dir, geo3k_parquet(tmp_path / "train.parquet"), tmp_path / "run",
                 "task.options.chat_template=true", "rollout.max_response_len=8")
    assert result.returncode == 0, result.stderr[-4000:]
    history = logged(tmp_path / "run")
    assert [h["step"] for h in history] == [1, 2, 3]
    assert {"reward/geo3k/accuracy/mean", "reward/geo3k/format/mean"} <= set(history[0]), sorted(history[0])
    assert all(h["check/logprob_max_diff"] < 1e-4 for h in history)


@pytest.mark.slow
@pytest.mark.e2e
def test_killed_and_resumed_visual_run_logs_what_the_uninterrupted_run_logged(tmp_path):
    """kill -9 after the first checkpoint of a visual-quickstart run (a short warm start: its model built here),
    then --resume: every metric but timings as the uninterrupted run logged it, images and vision tower included."""
    import random

    from runs import EVERY, STEPS, kill_when, rlcore_run, run_to_end, without_timings

    short = ["warm_start.steps=20", "warm_start.target_accuracy=0", "trainer.check_logprobs_every=2",
             "task.options.eval_size=24"]
    cache, plugins = tmp_path / "warm_start", "qwen2_vl,grpo,vllm"
    run_to_end(rlcore_run(tmp_path / "whole", cache, *short, preset="visual-quickstart", plugins=plugins))
    kill_at = random.randint(EVERY + 1, STEPS - 1)
    run_dir = tmp_path / "run"
    first = run_dir / "checkpoints" / f"step_{EVERY:08d}"
    kill_when(rlcore_run(run_dir, cache, *short, preset="visual-quickstart", plugins=plugins),
              lambda: len(logged(run_dir)) >= kill_at and first.exists())
    resumed = run_to_end(rlcore_run(run_dir, cache, "--resume", plugins=plugins))
    assert f"resuming from {run_dir}/checkpoints/step_0000000" in resumed.stderr
    whole = without_timings(logged(tmp_path / "whole"))
    assert len(whole) == STEPS and without_timings(logged(run_dir)) == whole, f"killed after step {kill_at}"


@pytest.mark.slow
@pytest.mark.e2e
def test_visual_quickstart_learns_to_count_and_name_colours(tmp_path):
    """The preset as a user runs it (its warm start built here), 50 of its 200 RL steps: held-out accuracy +0.15 or
    more over the warm start's (seed 0 measured +0.355 at step 50; docs/benchmarks.md), and the reward curve drawn."""
    run_dir = tmp_path / "run"
    result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen2_vl,grpo,vllm", "visual-quickstart",
                      "trainer.steps=50", "trainer.eval_every=0", "trainer.export_hf=false", "run.progress=false",
                      f"run.dir={run_dir}", f"warm_start.cache_dir={tmp_path / 'warm_start'}"], env=ENV)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_accuracy_before"] < 0.65, summary          # the warm start stopped early, leaving RL the rest
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.15, summary
    assert (run_dir / "reward_curve.png").stat().st_size > 0

"""A verl user's GSM8K job in miniature: a tiny Qwen3 checkpoint with a byte-level BPE tokenizer and a chat template,
GSM8K-format JSONL turned into verl Parquet by `rlcore dataset gsm8k`, GRPO with the math reward on real vLLM and
megatron-core, validation sampled twice per prompt. It need not learn; every part must run and agree. A random model
solves nothing, so a small shaping reward from a file (shorter is better) gives the update a gradient."""
import json
import os
import sys

import pytest
from runs import ENV, run_cli, run_to_end


@pytest.mark.slow
@pytest.mark.e2e
def test_grpo_on_gsm8k_parquet_with_a_chat_template_and_the_math_reward(tmp_path, chat_tokenizer):
    from rlcore_testing.models import tiny_checkpoint
    from rlcore_testing.gsm8k import gsm8k_lines
    from rlcore_model_qwen3.plugin import QWEN3

    ckpt = tmp_path / "ckpt"
    tiny_checkpoint(QWEN3, str(ckpt), vocab_size=len(chat_tokenizer), hidden_size=64, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=32, ffn_hidden_size=128, max_position_embeddings=512,
                    eos_token_id=chat_tokenizer.eos_token_id)
    chat_tokenizer.save_pretrained(ckpt)
    rlcore = [sys.executable, "-m", "rlcore.cli"]
    for split, count, offset in (("train", 24, 0), ("test", 6, 100)):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in gsm8k_lines(count, offset)))
        run_to_end(rlcore + ["dataset", "gsm8k", str(tmp_path / f"{split}.jsonl"), str(tmp_path / f"{split}.parquet"),
                             f"--split={split}"])
    (tmp_path / "shaping.py").write_text("def brevity(responses, metadata):\n"
                                         "    return [-len(r) / 200 for r in responses]\n")
    run_dir = tmp_path / "run"
    result = run_cli(rlcore + [
        "run", "--plugins=qwen3,grpo,vllm", "quickstart", f"model.path={ckpt}", "task.name=dataset",
        f"task.options.train_files=[{tmp_path / 'train.parquet'}]",
        f"task.options.val_files=[{tmp_path / 'test.parquet'}]", f"task.reward_fn={tmp_path / 'shaping.py'}:brevity",
        "task.rewards={math: 1.0, brevity: 0.1}",
        "trainer.steps=3", "trainer.prompts_per_step=4", "rollout.n=4", "rollout.max_response_len=48",
        "trainer.eval_every=2", "trainer.eval_n=2", "trainer.eval_temperature=1.0", "trainer.check_logprobs_every=1",
        "actor.micro_batch_size=16", "actor.optim.lr_warmup_steps=2", "run.progress=false", f"run.dir={run_dir}"],
        ENV, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    # the first prompt as the model sees it: Qwen3's chat format around GSM8K's question and verl's instruction
    assert ("<|im_start|>user\nTom has" in result.stderr and
            'final answer after "####".<|im_end|>\n<|im_start|>assistant\n' in result.stderr), result.stderr[-3000:]
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        assert h["check/logprob_max_diff"] < 1e-3                 # the engine agrees with the actor after a sync
        assert 0.0 <= h["reward/math/mean"] <= 1.0 and h["reward/brevity/mean"] < 0 and h["reward/failed"] == 0
        assert h["actor/grad_norm"] > 0
        assert h["prompt/length_mean"] > 60                        # BPE prompts of real length, not 5 characters
    assert [h["actor/lr"] for h in history][:2] == [5e-5, 1e-4]   # the quickstart's LR, warmed up over 2 updates
    evals = [h for h in history if "eval/openai/gsm8k/pass@2" in h]
    assert [h["step"] for h in evals] == [2, 3]
    assert all(h["eval/openai/gsm8k/mean@2"] <= h["eval/openai/gsm8k/pass@2"] for h in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert os.path.getsize(summary["plot"]) > 10_000 and os.path.isdir(run_dir / "hf")

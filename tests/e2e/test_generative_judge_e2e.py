"""A run whose reward is a generative judge's verdict, launched as a user launches it: the quickstart's own tiny model
behind vLLM, on an engine process of its own, reads a rubric made of the episode's prompt, its response and the
row's answer, and writes digits; the parser takes only two-digit verdicts, so some parse and the others are counted
failed (reward/failed, the reason logged once) while the run trains on. The policy's engine check holds at every step
while the judge's engine serves beside it."""
import math

from runs import logged, rlcore_run, run_to_end

# "49+97=" "145" -> "49+97=145+146=": the tiny adder continues with digits, two or three of them (measured: ~70%
# two, greedy, on the quickstart's starting model); the parser reads two-digit verdicts only
RUBRIC = "{prompt}{response}+{answer}="
TWO_DIGITS = r"^(\d\d)$"


def test_a_judge_behind_vllm_scores_and_its_unparsable_verdicts_are_counted(quickstart_model, warm_start_cache,
                                                                            tmp_path):
    (tmp_path / "rubric.txt").write_text(RUBRIC)
    run_dir = tmp_path / "run"
    result = run_to_end(rlcore_run(
        run_dir, warm_start_cache, "trainer.steps=3", "trainer.save_every=0", "trainer.eval_every=0",
        "trainer.export_hf=false", "trainer.check_logprobs_every=1", "reward_model.kind=generative",
        f"reward_model.path={quickstart_model}", f"reward_model.judge.template={tmp_path / 'rubric.txt'}",
        f"reward_model.judge.parser={TWO_DIGITS}", "reward_model.judge.max_tokens=4",
        "reward_model.judge.kv_cache_gib=0.05", "rollout.kv_cache_gib=0.05", plugins="qwen3,grpo,vllm"))
    history = logged(run_dir)
    assert len(history) == 3
    episodes = 16 * 8                                   # the quickstart's prompts_per_step x rollout.n
    for h in history:
        assert h["check/logprob_max_diff"] < 1e-3, h["check/logprob_max_diff"]   # the policy's engine, checked
        assert 0 < h["reward/failed"] < episodes, h["reward/failed"]              # some verdicts parse, some do not
        assert 10 <= h["reward/rm/mean"] <= 99                                    # the mean of the parsed ones
        assert "reward/exact_match/mean" in h                                     # the task's, logged at weight 0
        assert math.isfinite(h["reward/mean"])          # failed samples take their group's mean: the mean is finite
    assert "rm: JudgeUnparsable: no match of '^(\\\\d\\\\d)$' in the judge's answer" in result.stderr  # once
    assert result.stderr.count("has no score that reward_model.judge.parser") == 3         # the first 3 answers
    final = history[-1]
    assert 10 <= final["eval/reward/rm/mean"] <= 99                                # judged on the held-out set too

"""The generative judge's logic without an engine: the rubric (inline or a file, its placeholders filled in one
pass), the parser (one group; no match fails that episode, naming the answer), the prompt told apart from the
response in the policy's tokens, the config's one-line refusals, and a batch judged with one request each, all at
once, the unparsable ones failed and counted (``reward/failed``) and never scored 0."""
import json
import re

import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError, RlcoreError
from rlcore.plugins import load_plugins
from rlcore.rewards import RewardComposer
from rlcore.config.judge import DEFAULT_PARSER, compile_parser, load_template
from rlcore.rollout.judge import (GenerativeJudge, JudgeDied, JudgeMissing, JudgeTooLong, JudgeUnparsable,
                                  judge_engines, judge_rollout_config, load_judge, parse, prompt_text, render,
                                  request_seed)
from rlcore.specs import Completion
from rlcore_plugins.tasks.arithmetic import write_char_tokenizer


# --- the rubric -------------------------------------------------------------------------------------------------------
def test_placeholders_are_filled_in_one_pass_and_other_braces_kept():
    template = 'Q: {prompt}\nA: {response}\nRight: {answer}\nReply as {"score": n}. Score:'
    assert render(template, "2+2=", "the {answer} is {prompt}", {"answer": 4}) == (
        'Q: 2+2=\nA: the {answer} is {prompt}\nRight: 4\nReply as {"score": n}. Score:')


def test_a_row_without_the_answer_the_template_reads_fails_that_episode():
    with pytest.raises(JudgeMissing, match=r"reads \{answer\}, and this row's metadata has none \(keys: data_source"):
        render("{response} vs {answer}", None, "7", {"data_source": "x"})
    assert render("{response}", None, "7", {}) == "7"         # not read: not needed


def test_the_template_is_a_file_or_inline_text_with_a_response(tmp_path):
    rubric = tmp_path / "rubric.txt"
    rubric.write_text("Grade {response}.\nScore:")
    assert load_template(str(rubric)) == "Grade {response}.\nScore:"
    assert load_template("Grade {response}. Score:") == "Grade {response}. Score:"
    (tmp_path / "blind.txt").write_text("Grade it. Score:")
    with pytest.raises(ConfigError, match=r"'reward_model.judge.template' = '.*blind.txt' is not allowed \(the file "
                                          r"has no \{response\}\)"):
        load_template(str(tmp_path / "blind.txt"))
    with pytest.raises(ConfigError, match=r"\(it names no file, and as a template it has no \{response\}\)"):
        load_template(str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match=r"\(it is empty\)"):
        load_template("")


# --- the parser -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("answer,score", [("Score: 7", 7.0), ("score=-2.5 because", -2.5),
                                          ("Reasoning... SCORE : 10\nScore: 3", 10.0)])
def test_the_default_parser_reads_the_first_score(answer, score):
    assert parse(compile_parser(DEFAULT_PARSER), answer) == score


def test_an_answer_without_a_score_is_unparsable_the_answer_kept_beside():
    with pytest.raises(JudgeUnparsable, match=r"^no match of .* in the judge's answer$") as unparsable:
        parse(compile_parser(DEFAULT_PARSER), "I would give it eight")
    assert unparsable.value.answer == "I would give it eight"
    with pytest.raises(JudgeUnparsable, match="^a match whose group is no number of"):
        parse(re.compile(r"grade: (\w+)"), "grade: A")
    with pytest.raises(JudgeUnparsable, match="whose group is no number"):
        parse(re.compile(r"(\w+)"), "nan")                   # a non-finite score is none
    assert parse(compile_parser(r"^(\d\d)$"), "42") == 42.0


def test_a_parser_needs_exactly_one_group():
    with pytest.raises(ConfigError, match=r"'reward_model.judge.parser' = '\(a\)\(b\)' is not allowed \(it has 2 "
                                          r"groups\)"):
        compile_parser("(a)(b)")
    with pytest.raises(ConfigError, match=r"is not allowed \(not a regex: missing \)"):
        compile_parser("(a")


# --- the prompt, from the policy's tokens -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("chars")
    write_char_tokenizer(str(directory))
    return AutoTokenizer.from_pretrained(str(directory))


def test_the_prompt_is_the_sequence_less_its_response(chars):
    sequence = chars.encode("12+34=46", add_special_tokens=False) + [chars.eos_token_id]
    assert prompt_text(chars, sequence, "46") == "12+34="


class Bytes:
    """A tokenizer whose tokens 5 and 6 are the two bytes of "é": each alone decodes to the replacement character."""
    pieces = {1: "a", 2: "b", 5: b"\xc3", 6: b"\xa9"}

    def decode(self, ids, skip_special_tokens=True):
        raw = b"".join(p if isinstance(p, bytes) else p.encode() for p in map(self.pieces.__getitem__, ids))
        return raw.decode(errors="replace")


def test_a_character_split_over_the_boundary_is_cut_at_the_response_tokens():
    tokenizer = Bytes()
    response = tokenizer.decode([6, 2])                  # as the source decodes the response: "\ufffdb"
    assert tokenizer.decode([1, 5, 6, 2]) == "aéb"        # the whole does not end with it
    assert prompt_text(tokenizer, [1, 5, 6, 2], response) == "a\ufffd"
    with pytest.raises(JudgeMissing, match="its prompt cannot be told apart"):
        prompt_text(tokenizer, [1, 5, 6, 2], "zz")


# --- a batch, judged --------------------------------------------------------------------------------------------------
class Engines:
    """Judge engines that answer from a table (the rubric's text -> the answer), recording each call."""

    def __init__(self, tokenizer, answers: dict[str, str]):
        self.tokenizer, self.answers, self.calls = tokenizer, answers, []

    def generate(self, prompts, sampling, seeds):
        self.calls.append((len(prompts), sampling, list(seeds)))
        return [Completion(f"r{i}", self.tokenizer.encode(self.answers[self.tokenizer.decode(p)],
                                                          add_special_tokens=False), [], "stop")
                for i, p in enumerate(prompts)]


def judge_of(chars, template="{prompt}{response}+{answer}=", parser=r"^(\d\d)$", max_tokens=4, chat=False):
    judge = GenerativeJudge("rm", template, parser, max_tokens, 0.0, chat, seed=3)
    judge.tokenizer, judge.context, judge.path = chars, 20, "judge"
    return judge


def test_a_batch_is_judged_at_once_and_the_unparsable_are_failed_not_zero(chars, caplog):
    judge = judge_of(chars)
    engines = Engines(chars, {"1+2=3+3=": "6", "1+2=4+3=": "70", "5+5=10+10=": "20", "5+5=9+10=": "19="})
    judge.start(engines, chars)
    eos = chars.eos_token_id
    episodes = [("1+2=", "3"), ("1+2=", "4"), ("5+5=", "10"), ("5+5=", "9"), ("5+5=", "1234567890123")]
    responses = [r for _, r in episodes]
    metadata = [{"answer": "3"}, {"answer": "3"}, {"answer": "10"}, {"answer": "10"}, {"answer": "10"}]
    sequences = [chars.encode(p + r, add_special_tokens=False) + [eos] for p, r in episodes]
    scores = RewardComposer([(judge.spec(), 1.0)])(responses, metadata, sequences)
    assert len(engines.calls) == 1                    # every request at once, once: no retry per response
    asked, sampling, seeds = engines.calls[0]
    assert asked == 4 and (sampling.max_tokens, sampling.temperature) == (4, 0.0)   # the long one was not sent
    assert seeds == [request_seed(3, p) for p in [chars.encode(f"{p}{r}+{m['answer']}=", add_special_tokens=False)
                                                  for (p, r), m in zip(episodes[:4], metadata)]]
    assert scores.failed.tolist() == [True, False, False, True, True]
    assert scores.total[1] == 70.0 and scores.total[2] == 20.0
    assert scores.metrics()["reward/failed"] == 3.0 and scores.metrics()["reward/rm/mean"] == 45.0
    assert scores.reasons == {
        "rm: JudgeUnparsable: no match of '^(\\\\d\\\\d)$' in the judge's answer": 2,
        "rm: JudgeTooLong: the rubric and reward_model.judge.max_tokens = 4 exceed the judge's context, 20 tokens "
        "(max_position_embeddings of judge)": 1}
    shown = [r.getMessage() for r in caplog.records if "has no score" in r.getMessage()]
    assert len(shown) == 2 and "the judge's answer '6' has no score" in shown[0] and "'19='" in shown[1]


def test_the_rubric_may_go_through_the_judges_chat_template(chars):
    chars.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                           "{% if add_generation_prompt %}={% endif %}")
    try:
        judge = judge_of(chars, template="{response}+{response}", parser=r"^(\d+)$", chat=True)
        engines = Engines(chars, {"3+3=": "6"})             # the template's generation prompt: "="
        judge.start(engines, chars)
        assert judge(["3"], [{}], [chars.encode("1+2=3", add_special_tokens=False)]) == [6.0]
    finally:
        chars.chat_template = None


def test_an_unstarted_or_short_answering_judge_is_an_error(chars):
    judge = judge_of(chars, template="{response}=")
    with pytest.raises(RlcoreError, match="generative judge whose engines have not started"):
        judge(["1"], [{}], [[1]])

    class Short(Engines):
        def generate(self, prompts, sampling, seeds):
            return super().generate(prompts, sampling, seeds)[:-1]
    judge.start(Short(chars, {"1=": "11", "2=": "22"}), chars)
    with pytest.raises(JudgeDied, match="answered 1 of 2 requests"):
        judge(["1", "2"], [{}, {}], [[2], [3]])


# --- the config -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory, chars):
    directory = tmp_path_factory.mktemp("judge")
    chars.save_pretrained(str(directory))
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 16, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "max_position_embeddings": 64}))
    (directory / "model.safetensors").write_bytes(b"")
    return directory


def judged(judge_dir, *extra):
    return load_config("quickstart", ["reward_model.kind=generative", f"reward_model.path={judge_dir}", *extra])


def test_the_config_loader_refuses_in_one_line(judge_dir, tmp_path):
    (tmp_path / "r.txt").write_text("{response}")
    rubric = f"reward_model.judge.template={tmp_path / 'r.txt'}"
    for extra, message in [
            ((), "'reward_model.judge.template' = '' is not allowed (it is empty)"),
            ((rubric, "reward_model.judge.parser=(a)(b)"), "(it has 2 groups)"),
            ((rubric, "reward_model.kind=generativ"), "'reward_model.kind' = 'generativ' is not allowed: use scalar"),
            ((rubric, "reward_model.judge.max_tokens=0"), "'reward_model.judge.max_tokens' = 0 is not allowed"),
            ((rubric, "reward_model.judge.temperature=-1"), "'reward_model.judge.temperature' = -1.0 is not allowed"),
            ((rubric, "reward_training.synthetic_pairs=8"), "drop reward_training.* or use reward_model.kind=scalar")]:
        with pytest.raises(ConfigError) as refused:
            judged(judge_dir, *extra)
        assert message in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    with pytest.raises(ConfigError, match="'generative' without reward_model.path"):
        load_config("quickstart", ["reward_model.kind=generative", rubric])


def test_the_judges_engine_settings(judge_dir, tmp_path):
    (tmp_path / "r.txt").write_text("{response}")
    cfg = judged(judge_dir, f"reward_model.judge.template={tmp_path / 'r.txt'}", "rollout.kv_cache_gib=0.5",
                 "rollout.tp=1", "reward_model.judge.backend=hf")
    engine = judge_rollout_config(cfg)
    assert (engine.backend, engine.tp, engine.kv_cache_gib, engine.lora) == ("hf", 1, 0.5, "merged")
    assert judge_engines(cfg) == 1
    cfg.reward_model.world_size, cfg.reward_model.judge.kv_cache_gib = 2, 0.1
    assert judge_engines(cfg) == 2 and judge_rollout_config(cfg).kv_cache_gib == 0.1


def test_load_judge_registers_it_and_refuses_what_cannot_judge(judge_dir, tmp_path):
    (tmp_path / "r.txt").write_text("{response}")
    cfg = judged(judge_dir, f"reward_model.judge.template={tmp_path / 'r.txt'}")
    registry = load_plugins(["qwen3", "grpo", "vllm"]).registry
    judge = load_judge(cfg, registry)
    assert registry.get("rewards", "rm").fn is judge and registry.get("rewards", "rm").sequences
    assert (judge.path, judge.context) == (str(judge_dir), 64)

    classifier = tmp_path / "classifier"
    classifier.mkdir()
    config = json.loads((judge_dir / "config.json").read_text())
    (classifier / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForSequenceClassification"]}))
    vllm = registry.get("rollout_backends", "vllm")
    with pytest.raises(ConfigError, match="is a Qwen3ForSequenceClassification, not a causal LM"):
        GenerativeJudge("rm", "{response}", DEFAULT_PARSER, 4, 0.0, False).use(str(classifier), vllm, cfg.rollout)
    with pytest.raises(ConfigError, match="chat = true, and reward_model.path .* has no chat template"):
        GenerativeJudge("rm", "{response}", DEFAULT_PARSER, 4, 0.0, True).use(str(judge_dir), vllm, cfg.rollout)

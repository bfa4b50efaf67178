"""The chat-template token layer (rlcore_agent_tools.chat) and the token-exactness contract (issue 27): the contract
passes for the published Qwen3 (thinking on and off), Qwen2.5 and DeepSeek-V3 templates on tokenizers trained here,
and fails, showing where, for renderers that drift as verl#6501 and TRL#5144 did."""
from __future__ import annotations

import functools

import pytest

from rlcore_agent_tools.chat import ChatTokens, Transcript
from rlcore_agent_tools.testing.chat_contract import (FAMILIES, DroppedBoundaryChat, check_token_exactness,
                                                      family_tokenizer, random_conversations, reencoding_transcript)

CONVERSATIONS = 60


@functools.lru_cache(maxsize=None)
def tokenizer(family: str):
    return family_tokenizer(family)


def chat(family: str, cls=ChatTokens) -> ChatTokens:
    return cls(tokenizer(family), **FAMILIES[family].template_kwargs)


def decode(family: str, ids: list[int]) -> str:
    return tokenizer(family).decode(ids)


@pytest.mark.parametrize("family", ["qwen3", "qwen3-nothink", "qwen2.5", "deepseek-v3"])
def test_contract_passes(family):
    c = chat(family)
    report = check_token_exactness(c, random_conversations(c, CONVERSATIONS, seed=0))
    print(family, report.summary())
    assert report.conversations == CONVERSATIONS and report.turns > CONVERSATIONS
    assert report.cut_turns > 0 and report.non_canonical_turns > 0 and report.observation_tokens > 0
    assert report.render_checked > 0
    # a system message after the first turn: Qwen writes it in place, DeepSeek-V3 at the top (a new sample)
    assert (report.splits > 0) == (family == "deepseek-v3")
    if family == "qwen2.5":          # prefix-preserving: compared on every conversation without a cut turn
        assert set(report.render_skipped) <= {"with a cut turn (the template renders closed messages)"}
    if family.startswith("qwen3"):   # earlier turns re-rendered: not on all of them, and said so
        assert any(why.startswith("not prefix-preserving") for why in report.render_skipped)


def test_dropped_boundary_fails():
    """verl#6501's drift (the "\\n" after <|im_end|> left out of each observation) fails the contract, naming it."""
    c = chat("qwen2.5")
    with pytest.raises(AssertionError) as failure:
        check_token_exactness(chat("qwen2.5", DroppedBoundaryChat), random_conversations(c, CONVERSATIONS, seed=0))
    message = str(failure.value)
    print(message)
    assert "the observation: first difference at token 0" in message
    assert "want: ...  >>> '\\n' '<|im_start|>'" in message


def test_reencoding_transcript_fails():
    """Decoding the sampled turn and encoding it again (TRL#5144) changes the engine's ids: the contract fails."""
    c = chat("qwen3")
    with pytest.raises(AssertionError) as failure:
        check_token_exactness(c, random_conversations(c, CONVERSATIONS, seed=0), reencoding_transcript(c.tokenizer))
    print(failure.value)
    assert "each turn's engine tokens as returned" in str(failure.value)


@pytest.mark.parametrize("family, opens", [("qwen3", "<|im_start|>assistant\n"),
                                           ("qwen3-nothink", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
                                           ("qwen2.5", "<|im_start|>assistant\n")])
def test_qwen_observation_holds_the_newline_after_im_end(family, opens):
    c = chat(family)
    tool = {"role": "tool", "name": "multiply", "content": "42\nünïcode"}
    delta = c.observation([tool], tools=None)
    assert delta is not None
    assert decode(family, delta) == \
        f"\n<|im_start|>user\n<tool_response>\n42\nünïcode\n</tool_response><|im_end|>\n{opens}"
    assert decode(family, [c.end_of_turn]) == "<|im_end|>" and decode(family, c.after_end_of_turn) == "\n"


def test_close_inserts_end_of_turn_only_when_missing():
    c = chat("qwen3")
    assert c.close([5, 6, c.end_of_turn]) == []
    assert c.close([5, 6]) == [c.end_of_turn]
    assert c.close([]) == [c.end_of_turn]


def test_deepseek_tool_rounds_and_splits():
    c = chat("deepseek-v3")
    assert decode("deepseek-v3", [c.end_of_turn]) == "<｜end▁of▁sentence｜>" and c.after_end_of_turn == []
    tool = {"role": "tool", "name": "multiply", "content": "42"}
    first = c.observation([tool])
    later = c.observation([tool], history=[{"role": "user", "content": "q"}, {"role": "assistant", "content": None},
                                           tool, {"role": "assistant", "content": "a"}])
    assert first is not None and later is not None
    assert decode("deepseek-v3", first) == ("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>42<｜tool▁output▁end｜>"
                                            "<｜tool▁outputs▁end｜>")
    assert decode("deepseek-v3", later) == "\n<｜tool▁output▁begin｜>42<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    # the template moves every system message to the top: one added later is not a suffix
    assert c.observation([{"role": "system", "content": "be brief"}]) is None
    # it concatenates arguments as text: dict arguments are passed as JSON
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": "ü"}}}
    text = c.render_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": None,
                                                             "tool_calls": [call]}])
    assert c.string_arguments and '```json\n{"a": 3, "b": "ü"}\n```' in text


def test_transcript_masks_and_aligns():
    t = Transcript([1, 2])
    t.sampled([3, 4], [-0.5, -1.5])
    t.inserted([5])
    trajectory = t.trajectory(reward=1.0)
    assert trajectory.tokens == [1, 2, 3, 4, 5]
    assert trajectory.loss_mask == [False, False, True, True, False]
    assert trajectory.logprobs == [0.0, 0.0, -0.5, -1.5, 0.0] and trajectory.reward == 1.0
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        t.sampled([6, 7], [-1.0])


def test_a_tokenizer_without_template_is_refused():
    bare = family_tokenizer("qwen2.5")
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokens(bare)

"""The token-exactness contract every model family's chat template is tested against (issue 27).

For random multi-turn conversations (``random_conversations``) replayed through a ``ChatTokens`` and ``Transcript``
the way an agent builds them, ``check_token_exactness`` asserts:

- every sampled turn is in the trajectory verbatim, where the engine put it (also when the engine sampled a
  tokenization that is not the tokenizer's own, which decoding and re-encoding would change);
- the trajectory is the prompt, then each turn's engine tokens followed by its closing and observation tokens;
- ``loss_mask`` is true exactly on the sampled tokens, ``logprobs`` are the engine's there and 0.0 elsewhere;
- each observation is the template's own text after the end-of-turn token (so a boundary such as Qwen's ``\\n`` after
  ``<|im_end|>`` cannot go missing), encoded as the template's rendering encodes it;
- rendering the final messages with the template gives the trajectory's tokens, on every conversation where the
  template is prefix-preserving: each turn renders in place as it was sampled and stays so as the conversation grows
  (Qwen3 strips earlier thinking when re-rendering, so there it runs on fewer conversations; the report says on how
  many, and why the others were left out).

The "engine" is a model that follows the template: for an assistant message it samples what the template renders for
that message after the generation prompt (its content, tool calls, end-of-turn), with random logprobs; some turns are
cut before their end-of-turn (closed by ``ChatTokens.close``), some sampled in a non-canonical tokenization.

Tokenizers are built here (``family_tokenizer``): a byte-level BPE trained in-process with the family's special tokens
and its published chat template from ``chat_templates/`` (sources in chat_templates/SOURCES.md); nothing downloaded.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib import resources
from typing import Callable

from rlcore_agent_tools.chat import ChatTokens, Transcript

# ---- tokenizers of the families --------------------------------------------------------------------------------------

_QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
_DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                     "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                     "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]


@dataclass(frozen=True)
class Family:
    template: str                      # file under chat_templates/
    special: list[str]                 # special tokens (the first is the pad token)
    added: list[str]                   # added, not special (kept when decoding with skip_special_tokens)
    eos: str
    bos: str | None = None
    template_kwargs: dict = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "qwen3": Family("qwen3.jinja", _QWEN_SPECIAL, _QWEN_ADDED, eos="<|im_end|>"),
    "qwen3-nothink": Family("qwen3.jinja", _QWEN_SPECIAL, _QWEN_ADDED, eos="<|im_end|>",
                            template_kwargs={"enable_thinking": False}),
    "qwen2.5": Family("qwen2_5.jinja", _QWEN_SPECIAL, _QWEN_ADDED, eos="<|im_end|>"),
    "deepseek-v3": Family("deepseek_v3.jinja", _DEEPSEEK_SPECIAL, ["<think>", "</think>"],
                          eos="<｜end▁of▁sentence｜>", bos="<｜begin▁of▁sentence｜>"),
}

_QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
_WORDS = ["the", "sum", "of", "is", "multiply", "result", "let", "me", "check", "answer", "value", "tool", "call",
          "search", "python", "print", "return", "error", "ok", "done", "naïve", "café", "日本語", "数字", "Ω", "😀",
          "x", "y", "1234", "56", "7", "-3.5", "true", "null", "\n", "\n\n", "  ", "\t", "{", "}", "[", "]", ":", ",",
          '"', "'", "<", ">", "/", "\\", "#", "`"]


def chat_template(name: str) -> str:
    """A bundled chat template (chat_templates/<name>), as published."""
    return resources.files("rlcore_agent_tools.testing").joinpath("chat_templates", name).read_text(encoding="utf-8")


def family_tokenizer(family: str):
    """A byte-level BPE tokenizer trained here with ``family``'s special tokens and its published chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family not in FAMILIES:
        raise ValueError(f"family_tokenizer: unknown family {family!r}; the families are {sorted(FAMILIES)}")
    spec = FAMILIES[family]
    template = chat_template(spec.template)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([      # Qwen2's split (a run of newlines is one piece), then bytes
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    rng = random.Random(0)
    corpus = [template, json.dumps(_TOOLS)] + [" ".join(rng.choices(_WORDS, k=12)) for _ in range(200)]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=700, special_tokens=spec.special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=spec.eos, pad_token=spec.special[0],
                                        bos_token=spec.bos, chat_template=template)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added])
    return tokenizer


def family_chat(family: str) -> ChatTokens:
    """``ChatTokens`` of ``family``'s tokenizer and template (with its template kwargs, e.g. thinking off)."""
    return ChatTokens(family_tokenizer(family), **FAMILIES[family].template_kwargs)


# ---- random conversations, sampled by a model that follows the template ----------------------------------------------

_TOOLS = [
    {"type": "function", "function": {"name": "multiply", "description": "Multiply two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the notes for a query.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"]}}},
    {"type": "function", "function": {"name": "python", "description": "Run Python code; returns its output.",
                                      "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                     "required": ["code"]}}},
]


@dataclass
class Turn:
    message: dict              # the assistant message as the final conversation holds it
    tokens: list[int]          # what the engine returned for the turn
    logprobs: list[float]
    cut: bool                  # stopped before its end-of-turn token
    canonical: bool            # ``tokens`` are the tokenizer's own encoding of their text
    observed: list[dict]       # the messages that follow the turn (tool results, a user turn); [] after the last


@dataclass
class Conversation:
    messages: list[dict]       # before the first sampled turn
    tools: list[dict] | None
    turns: list[Turn]

    def final_messages(self) -> list[dict]:
        out = list(self.messages)
        for turn in self.turns:
            out += [turn.message, *turn.observed]
        return out


def random_conversations(chat: ChatTokens, count: int, seed: int) -> list[Conversation]:
    """``count`` conversations from ``seed``: 1-4 sampled turns, tool calls with JSON arguments, tool results with
    newlines and unicode, an occasional user turn (now and then after a system message), empty contents, thinking
    where the template has it, cut turns and non-canonical tokenizations."""
    rng = random.Random(seed)
    content_with_calls = _renders_content_with_calls(chat)
    return [_conversation(chat, rng, content_with_calls) for _ in range(count)]


def _text(rng: random.Random, empty: float = 0.1) -> str:
    if rng.random() < empty:
        return ""
    return "".join(rng.choice(_WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 10))).strip() or "ok"


def _arguments(rng: random.Random, name: str) -> dict:
    if name == "multiply":
        return {"a": rng.randint(-999, 9999), "b": rng.randint(0, 999)}
    if name == "search":
        return {"query": _text(rng, 0.0), "limit": rng.randint(1, 5)}
    return {"code": f"print({rng.randint(0, 99)} * 2)\nx = {json.dumps(_text(rng, 0.0), ensure_ascii=False)}"}


def _conversation(chat: ChatTokens, rng: random.Random, content_with_calls: bool) -> Conversation:
    tools = _TOOLS if rng.random() < 0.7 else None
    messages = ([{"role": "system", "content": _text(rng)}] if rng.random() < 0.3 else []) + \
        [{"role": "user", "content": _text(rng, 0.05)}]
    turns: list[Turn] = []
    count = rng.randint(1, 4)
    for i in range(count):
        last = i == count - 1
        calls = tools is not None and not last and rng.random() < 0.7
        message = _assistant_message(chat, rng, tools, calls, content_with_calls)
        body = _sampled_turn(chat, message, tools)
        canonical = True
        if rng.random() < 0.3:
            body, canonical = _non_canonical(chat, rng, body)
        cut = rng.random() < 0.08 and len(body) > 2
        if cut:
            body = body[:rng.randint(1, len(body) - 2)]
            message = {"role": "assistant", "content": chat.tokenizer.decode(body)}
        observed: list[dict] = []
        if not last:
            if calls and not cut:
                observed = [{"role": "tool", "name": c["function"]["name"], "content": _tool_result(rng)}
                            for c in message["tool_calls"]]
            if not observed or rng.random() < 0.15:
                if rng.random() < 0.1:      # a template may not write it in place (DeepSeek-V3): a split
                    observed.append({"role": "system", "content": _text(rng, 0.0)})
                observed.append({"role": "user", "content": _text(rng)})
        turns.append(Turn(message, body, [-rng.random() * 5 for _ in body], cut, canonical, observed))
    return Conversation(messages, tools, turns)


def _assistant_message(chat: ChatTokens, rng: random.Random, tools: list[dict] | None, calls: bool,
                       content_with_calls: bool) -> dict:
    message: dict = {"role": "assistant", "content": _text(rng, 0.15)}
    if calls:
        assert tools is not None
        chosen = [rng.choice(tools)["function"]["name"] for _ in range(rng.randint(1, 2))]
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": _arguments(rng, n)}}
                                 for n in chosen]
        if not content_with_calls or rng.random() < 0.4:
            message["content"] = None
    if "reasoning_content" in chat.template and rng.random() < 0.4:
        thought = {**message, "reasoning_content": _text(rng, 0.0)}
        if _template_turn(chat, thought, tools) is not None:     # not with thinking off
            message = thought
    return message


def _tool_result(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.1:
        return ""
    if kind < 0.5:
        return json.dumps({"result": rng.randint(-10 ** 6, 10 ** 6), "note": _text(rng)}, ensure_ascii=False)
    return "\n".join(_text(rng) for _ in range(rng.randint(1, 4)))


def _sampled_turn(chat: ChatTokens, message: dict, tools: list[dict] | None) -> list[int]:
    body = _template_turn(chat, message, tools)
    if body is None:
        raise AssertionError(f"the template's generation prompt is not a prefix of its rendering of {message}")
    return body


def _template_turn(chat: ChatTokens, message: dict, tools: list[dict] | None) -> list[int] | None:
    """What a model following the template samples for ``message``: the template's rendering of it after the
    generation prompt, through its end-of-turn token (appended where the template writes none); None when the
    rendering does not extend the generation prompt (a message such a model cannot sample)."""
    context = [{"role": "user", "content": "q"}]
    prompt, closed = chat.prompt(context, tools), chat.render(context + [message], tools)
    if closed[:len(prompt)] != prompt:
        return None
    body = closed[len(prompt):]
    if chat.end_of_turn in body:
        return body[:body.index(chat.end_of_turn) + 1]
    return body + [chat.end_of_turn]


def _non_canonical(chat: ChatTokens, rng: random.Random, body: list[int]) -> tuple[list[int], bool]:
    """``body`` with one multi-character token sampled as its characters' tokens instead: same text, other ids."""
    tokenizer = chat.tokenizer
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    candidates = []
    for i, t in enumerate(body):
        text = tokenizer.decode([t])
        if t not in special and len(text) > 1 and text.isascii():
            pieces = [p for ch in text for p in tokenizer.encode(ch, add_special_tokens=False)]
            if len(pieces) > 1:
                candidates.append((i, pieces))
    if not candidates:
        return body, True
    i, pieces = rng.choice(candidates)
    return body[:i] + pieces + body[i + 1:], False


def _renders_content_with_calls(chat: ChatTokens) -> bool:
    """Whether the template writes an assistant message's content and its tool calls together (DeepSeek-V3 writes
    the calls only of a message without content)."""
    call = {"type": "function", "function": {"name": "probe_tool", "arguments": {"a": 1}}}
    text = chat.render_text([{"role": "user", "content": "q"},
                             {"role": "assistant", "content": "probe_text", "tool_calls": [call]}])
    return "probe_text" in text and "probe_tool" in text


# ---- the contract ----------------------------------------------------------------------------------------------------

@dataclass
class ContractReport:
    conversations: int = 0
    samples: int = 0
    turns: int = 0
    sampled_tokens: int = 0
    observation_tokens: int = 0
    splits: int = 0                  # observations the template could not render as a suffix (new samples)
    cut_turns: int = 0
    non_canonical_turns: int = 0
    render_checked: int = 0          # conversations whose final rendering was compared with the trajectory
    render_skipped: dict[str, int] = field(default_factory=dict)     # why the others were not

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.render_skipped.items())) or "none"
        return (f"{self.conversations} conversations, {self.samples} samples, {self.turns} turns "
                f"({self.cut_turns} cut, {self.non_canonical_turns} non-canonical), {self.sampled_tokens} sampled "
                f"and {self.observation_tokens} inserted tokens, {self.splits} splits; render(final) == tokens "
                f"checked on {self.render_checked}, skipped: {skipped}")


def check_token_exactness(chat: ChatTokens, conversations: list[Conversation],
                          transcript: Callable[[list[int]], Transcript] = Transcript) -> ContractReport:
    """Replays ``conversations`` through ``chat`` and ``transcript`` as an agent does and asserts the contract (see
    the module's docstring). Raises AssertionError naming the conversation, the check and the first difference,
    shown as decoded tokens around it; returns what was checked."""
    report = ContractReport()
    for number, conversation in enumerate(conversations):
        try:
            _check_conversation(chat, conversation, transcript, report)
        except AssertionError as e:
            raise AssertionError(f"conversation {number}: {e}") from None
    return report


@dataclass
class _Span:
    tokens: list[int]
    logprobs: list[float] | None     # None: inserted


def _check_conversation(chat: ChatTokens, conversation: Conversation, transcript: Callable[[list[int]], Transcript],
                        report: ContractReport) -> None:
    tools, history = conversation.tools, list(conversation.messages)
    samples: list[tuple[Transcript, list[_Span]]] = [(transcript(chat.prompt(history, tools)), [])]
    expected_prompt = [chat.prompt(history, tools)]
    for turn in conversation.turns:
        sample, spans = samples[-1]
        spans.append(_Span(turn.tokens, turn.logprobs))
        sample.sampled(list(turn.tokens), list(turn.logprobs))
        history.append(turn.message)
        report.turns += 1
        report.sampled_tokens += len(turn.tokens)
        report.cut_turns += turn.cut
        report.non_canonical_turns += not turn.canonical
        if not turn.observed:
            continue
        closing = chat.close(turn.tokens)
        _expect(chat, closing, [] if turn.tokens[-1:] == [chat.end_of_turn] else [chat.end_of_turn],
                "the tokens closing the turn")
        delta = chat.observation(turn.observed, tools, history=history)
        history += turn.observed
        if delta is None:
            report.splits += 1
            spans.append(_Span(closing, None))
            sample.inserted(closing)
            expected_prompt.append(chat.prompt(history, tools))
            samples.append((transcript(expected_prompt[-1]), []))
            continue
        _expect(chat, delta, _template_observation(chat, turn.observed, tools, history), "the observation")
        spans.append(_Span(closing + delta, None))
        sample.inserted(closing + delta)
        report.observation_tokens += len(closing) + len(delta)
    for (sample, spans), prompt in zip(samples, expected_prompt):
        _check_sample(chat, sample, spans, prompt)
    report.conversations += 1
    report.samples += len(samples)
    why = _render_check_skipped(chat, conversation, len(samples))
    if why:
        report.render_skipped[why] = report.render_skipped.get(why, 0) + 1
        return
    final = chat.render(conversation.final_messages(), tools)
    tokens = samples[0][0].tokens
    if all(t.canonical for t in conversation.turns):
        _expect(chat, tokens + chat.after_end_of_turn, final, "render(final messages) vs the trajectory")
    else:                       # the same text; the engine's ids are not the template's encoding of it
        got, want = chat.tokenizer.decode(tokens + chat.after_end_of_turn), chat.tokenizer.decode(final)
        assert got == want, f"render(final messages) vs the trajectory, as text: {_text_difference(got, want)}"
    report.render_checked += 1


def _check_sample(chat: ChatTokens, sample: Transcript, spans: list[_Span], prompt: list[int]) -> None:
    n = len(sample.tokens)
    assert len(sample.loss_mask) == n and len(sample.logprobs) == n, (
        f"tokens ({n}), loss_mask ({len(sample.loss_mask)}) and logprobs ({len(sample.logprobs)}) do not align")
    expected_tokens, expected_mask, expected_logprobs = list(prompt), [False] * len(prompt), [0.0] * len(prompt)
    for span in spans:
        expected_tokens += span.tokens
        expected_mask += [span.logprobs is not None] * len(span.tokens)
        expected_logprobs += span.logprobs if span.logprobs is not None else [0.0] * len(span.tokens)
    _expect(chat, sample.tokens, expected_tokens, "the trajectory vs the prompt, then each turn's engine tokens "
                                                  "as returned and its closing and observation tokens")
    if sample.loss_mask != expected_mask:
        i = next(i for i, (a, b) in enumerate(zip(sample.loss_mask, expected_mask)) if a != b)
        raise AssertionError(f"loss_mask is {sample.loss_mask[i]} at token {i} "
                             f"({chat.tokenizer.decode(sample.tokens[i:i + 1])!r}), which was "
                             f"{'sampled' if expected_mask[i] else 'not sampled'}")
    if sample.logprobs != expected_logprobs:
        i = next(i for i, (a, b) in enumerate(zip(sample.logprobs, expected_logprobs)) if a != b)
        raise AssertionError(f"logprobs[{i}] is {sample.logprobs[i]}, the engine's is {expected_logprobs[i]}")


def _template_observation(chat: ChatTokens, messages: list[dict], tools: list[dict] | None,
                          history: list[dict]) -> list[int]:
    """The reference observation, from the template's text: what it writes after the base's last end-of-turn token
    when ``messages`` and a generation prompt follow the base, encoded on its own."""
    rounds = 1 if any(m.get("role") == "tool" for m in history[:len(history) - len(messages)]) else 0
    base = chat.base_messages(rounds)
    before = chat.render_text(base, tools)
    after = chat.render_text(base + messages, tools, add_generation_prompt=True)
    end = chat.tokenizer.decode([chat.end_of_turn])
    cut = before.rindex(end) + len(end)
    assert after[:cut] == before[:cut], "the template's text with the observation does not extend the base's"
    return chat.encode(after[cut:])


def _render_check_skipped(chat: ChatTokens, conversation: Conversation, samples: int) -> str | None:
    """Why rendering the final messages cannot be expected to give the trajectory, or None when it can: the template
    must render every turn in place as it was sampled and keep it so as the conversation grows."""
    if samples > 1:
        return "split into samples"
    if any(t.cut for t in conversation.turns):
        return "with a cut turn (the template renders closed messages)"
    final = conversation.final_messages()
    rendered = chat.render(final, conversation.tools)
    decode = chat.tokenizer.decode
    index = len(conversation.messages)
    for turn in conversation.turns:
        prompt = chat.prompt(final[:index], conversation.tools)
        closed = chat.render(final[:index + 1], conversation.tools)
        if closed[:len(prompt)] != prompt or decode(closed[len(prompt):]) != decode(turn.tokens +
                                                                                    chat.after_end_of_turn):
            return "not prefix-preserving (a turn renders unlike it was sampled)"
        if rendered[:len(closed)] != closed:
            return "not prefix-preserving (a later message changes an earlier turn)"
        index += 1 + len(turn.observed)
    return None


def _expect(chat: ChatTokens, got: list[int], want: list[int], what: str) -> None:
    if got == want:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    lo = max(0, i - 6)
    show = (lambda ids: " ".join(repr(chat.tokenizer.decode([t])) for t in ids))  # noqa: E731
    raise AssertionError(
        f"{what}: first difference at token {i} (lengths {len(got)} and {len(want)})\n"
        f"  got:  ... {show(got[lo:i])} >>> {show(got[i:i + 6])}\n"
        f"  want: ... {show(want[lo:i])} >>> {show(want[i:i + 6])}")


def _text_difference(got: str, want: str) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    lo = max(0, i - 30)
    return f"first difference at character {i}: got {got[lo:i + 30]!r}, want {want[lo:i + 30]!r}"


# ---- drifting renderers: what the contract must catch ----------------------------------------------------------------

class DroppedBoundaryChat(ChatTokens):
    """verl#6501: drops what the template writes after the end-of-turn token (Qwen's ``\\n`` after ``<|im_end|>``)
    from every observation."""

    def observation(self, messages, tools=None, history=None):
        delta = super().observation(messages, tools, history)
        n = len(self.after_end_of_turn)
        if delta is None or not n or delta[:n] != self.after_end_of_turn:
            return delta
        return delta[n:]


def reencoding_transcript(tokenizer) -> Callable[[list[int]], Transcript]:
    """A transcript that decodes each sampled turn and encodes it again, as agents that keep text do (TRL#5144)."""

    class Reencoding(Transcript):
        def sampled(self, tokens: list[int], logprobs: list[float], routed_experts=None) -> None:
            again = tokenizer.encode(tokenizer.decode(tokens), add_special_tokens=False)
            super().sampled(again, (list(logprobs) + [0.0] * len(again))[:len(again)], routed_experts)

    return Reencoding

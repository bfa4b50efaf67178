"""The chat-template token layer: a conversation's token ids built turn by turn, never re-rendered.

What the policy sampled is kept as sampled: decoding and re-encoding it can give other ids (a tokenizer has many
tokenizations of one text and the engine need not sample the canonical one; TRL#5144), and re-rendering the whole
conversation can change earlier turns (Qwen3 strips earlier ``<think>`` blocks; verl's docs: single-turn PPO "did not
even converge"). What comes between two sampled turns is the template's own text, cut from rendering a *fixed base*
(a synthetic conversation that ends with a closed assistant turn) with and without the new messages: everything after
the base's end-of-turn token, so a boundary the template writes after it (Qwen's ``\\n`` after ``<|im_end|>``, the one
verl#6501 dropped) is part of the observation. When the base's rendering is not a prefix of the extended one, the
template cannot be extended exactly and ``observation`` says so (None): the caller starts a new training sample.
"""
from __future__ import annotations

import json
from typing import Any

import torch

from rlcore.routed_experts import joined
from rlcore.trajectory import Trajectory

PLACEHOLDER = "x"                 # the fixed base's contents: any short text; only the boundaries are kept


class ChatTokens:
    """Token ids of a conversation under a chat template, built turn by turn: what the policy sampled is kept as
    sampled (never decoded and re-encoded); what comes between turns is the template's suffix against a fixed base."""

    def __init__(self, tokenizer, chat_template: str | None = None, **template_kwargs):
        # chat_template None = the tokenizer's own; template_kwargs go to apply_chat_template (enable_thinking=False)
        self.tokenizer = tokenizer
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):
            raise ValueError(f"ChatTokens: the tokenizer has several named chat templates ({', '.join(template)}); "
                             "pass chat_template= the one the model is served with")
        if not template:
            raise ValueError("ChatTokens: the tokenizer has no chat template and none was given; pass chat_template=")
        self.template: str = template
        self.template_kwargs = template_kwargs
        self._bases: dict[tuple[int, str], tuple[list[int], int]] = {}
        self.string_arguments = self._needs_string_arguments()
        self.end_of_turn: int = self._end_of_turn()
        base, cut = self._base_ids(0, None)
        self.after_end_of_turn: list[int] = base[cut:]     # what the template writes after a closed turn ("\n")

    # ---- rendering -------------------------------------------------------------------------------------------------
    def render_text(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (tool-call arguments as JSON text where the template needs it)."""
        return self.tokenizer.apply_chat_template(
            self._for_template(messages), tools=tools, chat_template=self.template, tokenize=False,
            add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Rendered text to ids: the template writes its special tokens (bos included) itself."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation so far with the generation prompt: what the first turn is sampled from."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt=True))

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The whole conversation as the template renders it (no generation prompt): the contract's reference."""
        return self.encode(self.render_text(messages, tools))

    # ---- between turns ---------------------------------------------------------------------------------------------
    def close(self, sampled: list[int]) -> list[int]:
        """Tokens that close a turn which did not end with end_of_turn (stopped at a stop string, or cut): e.g.
        [<|im_end|>]; [] when it ended with end_of_turn. They are inserted: loss mask 0, no logprob."""
        return [] if sampled and sampled[-1] == self.end_of_turn else [self.end_of_turn]

    def observation(self, messages: list[dict], tools: list[dict] | None = None,
                    history: list[dict] | None = None) -> list[int] | None:
        """The tokens that follow a closed assistant turn to add ``messages`` (tool results, a user turn) and open the
        next assistant turn (generation prompt included), e.g. "\\n<|im_start|>user\\n<tool_response>..." for Qwen
        (the "\\n" after <|im_end|> that the template inserts is part of it); None when the template cannot render
        them as an exact suffix (the caller then starts a new training sample from ``prompt(all messages)``).

        ``history`` (optional, the conversation before ``messages``) only tells whether tool results came before: a
        template may write a later tool-output block unlike the first (DeepSeek-V3 opens ``<｜tool▁outputs▁begin｜>``
        once per conversation), so the base then holds one earlier tool round. Nothing else of it is rendered."""
        rounds = 1 if history and any(m.get("role") == "tool" for m in history) else 0
        base_messages = self.base_messages(rounds)
        base, cut = self._base_ids(rounds, tools)
        extended = self.prompt(base_messages + list(messages), tools)
        if extended[:cut] != base[:cut]:
            return None
        return extended[cut:]

    def _base_ids(self, rounds: int, tools: list[dict] | None) -> tuple[list[int], int]:
        """The fixed base's ids and where its last end-of-turn token ends (cached: one rendering per tool set)."""
        key = (rounds, json.dumps(tools, sort_keys=True, default=str))
        if key not in self._bases:
            base = self.encode(self.render_text(self.base_messages(rounds), tools))
            self._bases[key] = (base, _last_index(base, self.end_of_turn) + 1)
        return self._bases[key]

    # ---- what the template needs -----------------------------------------------------------------------------------
    @staticmethod
    def base_messages(tool_rounds: int) -> list[dict]:
        """The fixed base: an assistant turn with no user turn before it, so that templates which render an assistant
        turn by where it stands (Qwen3: after the last user query, last or not) render it the same whatever follows."""
        base = [{"role": "assistant", "content": PLACEHOLDER}]
        for _ in range(tool_rounds):
            base += [{"role": "tool", "content": PLACEHOLDER, "name": PLACEHOLDER},
                     {"role": "assistant", "content": PLACEHOLDER}]
        return base

    def _end_of_turn(self) -> int:
        """The first special token the template writes after an assistant turn's content."""
        marker = "rlcore-end-of-turn-probe"
        text = self.render_text([{"role": "user", "content": PLACEHOLDER}, {"role": "assistant", "content": marker}])
        after = self.encode(text[text.index(marker) + len(marker):])
        special = set(self.tokenizer.all_special_ids) | set(self.tokenizer.get_added_vocab().values())
        found = next((i for i in after if i in special), None)
        if found is None:
            raise ValueError(f"ChatTokens: the chat template writes no special token after an assistant turn "
                             f"({text[text.index(marker):]!r}), so its turns have no end-of-turn token to close them")
        return found

    def _needs_string_arguments(self) -> bool:
        """Whether the template takes tool-call arguments only as JSON text (DeepSeek-V3 concatenates them)."""
        call = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
        probe = [{"role": "user", "content": PLACEHOLDER}, {"role": "assistant", "content": None, "tool_calls": [call]}]
        try:
            self.tokenizer.apply_chat_template(probe, chat_template=self.template, tokenize=False,
                                               **self.template_kwargs)
            return False
        except TypeError:
            return True
        except Exception:       # a template that takes no tool calls at all: nothing to convert
            return False

    def _for_template(self, messages: list[dict]) -> list[dict]:
        if not self.string_arguments:
            return messages
        return [_with_string_arguments(m) if m.get("tool_calls") else m for m in messages]


class Transcript:
    """One training sample's tokens as they are built: the prompt, then sampled turns (loss mask 1, their logprobs)
    and inserted/observation tokens (mask 0, logprob 0.0)."""

    def __init__(self, prompt: list[int]):
        self.tokens: list[int] = list(prompt)
        self.loss_mask: list[bool] = [False] * len(self.tokens)
        self.logprobs: list[float] = [0.0] * len(self.tokens)
        self.routed_experts: torch.Tensor | None = None
        self._turns = 0

    def sampled(self, tokens: list[int], logprobs: list[float], routed_experts: torch.Tensor | None = None) -> None:
        """The engine's tokens of one turn, as sampled, with their behaviour logprobs and, from an engine that
        returns them, its routed experts (the turn's prompt was this transcript: the rows of tokens an earlier turn
        fed are kept, those of the observations come from this turn's prefill)."""
        if len(tokens) != len(logprobs):
            raise ValueError(f"Transcript.sampled: {len(tokens)} tokens but {len(logprobs)} logprobs")
        self.routed_experts = routed_experts if self._turns == 0 else joined(self.routed_experts, routed_experts)
        self._turns += 1
        self.tokens += tokens
        self.loss_mask += [True] * len(tokens)
        self.logprobs += [float(lp) for lp in logprobs]

    def inserted(self, tokens: list[int]) -> None:
        """Tokens the policy did not sample (a closing end-of-turn, an observation): not trained on."""
        self.tokens += tokens
        self.loss_mask += [False] * len(tokens)
        self.logprobs += [0.0] * len(tokens)

    def trajectory(self, **fields) -> Trajectory:
        return Trajectory(tokens=list(self.tokens), loss_mask=list(self.loss_mask), logprobs=list(self.logprobs),
                          routed_experts=self.routed_experts, **fields)


def _with_string_arguments(message: dict) -> dict:
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function", call)
        arguments: Any = function.get("arguments")
        if not isinstance(arguments, str):
            function = {**function, "arguments": json.dumps(arguments, ensure_ascii=False)}
        calls.append({**call, "function": function} if "function" in call else function)
    return {**message, "tool_calls": calls}


def _last_index(ids: list[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    raise ValueError(f"ChatTokens: the fixed base's rendering holds no end-of-turn token (id {token})")

"""The ``hermes`` tool-call parser: the calls Qwen2.5 / Qwen3 / Hermes models write, ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, read from an assistant turn's text; a call that cannot be read is a ``ToolCall``
with ``error`` set, which the model reads back as the call's result."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlcore_agent_tools.specs import ToolParserSpec
from rlcore_agent_tools.tools import json_type


@dataclass
class ToolCall:
    """One tool call read from the model's output. ``error``: why it could not be read (the model sees it as the
    call's result, and it is counted); ``name`` is kept when it was readable, so errors count per tool."""
    name: str
    arguments: dict
    error: str = ""
    id: str = ""


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _call_blocks(text: str) -> list[tuple[int, int, Any, str]]:
    """(start, end, parsed JSON, problem) of each ``<tool_call>`` block, in order; ``end`` is past its closing tag
    (the text's end for an unclosed one). A closing tag inside a JSON string (code that prints one) does not end
    the block: the first closing tag after which the body parses does."""
    blocks = []
    start = text.find(_OPEN)
    while start >= 0:
        body = start + len(_OPEN)
        close = text.find(_CLOSE, body)
        if close < 0:
            blocks.append((start, len(text), None, f"unclosed {_OPEN}: end every call with {_CLOSE}"))
            break
        parsed, problem = None, ""
        try:
            parsed = json.loads(text[body:close])
        except json.JSONDecodeError as e:
            problem = f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
            later = text.find(_CLOSE, close + len(_CLOSE))
            while later >= 0 and text.find(_OPEN, body, later) < 0:
                try:
                    parsed, close, problem = json.loads(text[body:later]), later, ""
                    break
                except json.JSONDecodeError:
                    later = text.find(_CLOSE, later + len(_CLOSE))
        blocks.append((start, close + len(_CLOSE), parsed, problem))
        start = text.find(_OPEN, close + len(_CLOSE))
    return blocks


def hermes_calls(text: str) -> list[ToolCall]:
    """Qwen2.5 / Qwen3 / Hermes format: each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the
    text, in order. Bad JSON, a missing name, arguments that are not an object, an unclosed tag: a ToolCall with
    ``error`` set (missing arguments are no arguments)."""
    return [ToolCall("", {}, error=problem) if problem else _hermes_call(parsed)
            for _, _, parsed, problem in _call_blocks(text)]


def _hermes_call(parsed: Any) -> ToolCall:
    expected = 'write {"name": "<tool>", "arguments": {...}}'
    if not isinstance(parsed, dict):
        return ToolCall("", {}, error=f"the tool call is {json_type(parsed)}, not an object; {expected}")
    name = parsed.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, error=f'the tool call has no "name"; {expected}')
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, error=f'{name}: "arguments" must be a JSON object, got {json_type(arguments)}')
    return ToolCall(name, arguments)


def content_before_calls(text: str) -> str:
    """The assistant's text outside its ``<tool_call>`` blocks (stripped pieces joined by newlines). Chat
    templates write a message's content before its calls, so text written between or after calls moves there."""
    pieces, position = [], 0
    for start, end, _, _ in _call_blocks(text):
        pieces.append(text[position:start])
        position = end
    pieces.append(text[position:])
    return "\n".join(p.strip() for p in pieces if p.strip())


HERMES = ToolParserSpec("hermes", hermes_calls)

"""One verl key's fate (``Line``) and the one-line refusal, shared by the translator (``translate``) and the keys it
reads together (``groups``), so that ``groups`` does not import the translator that calls it."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rlcore.errors import ConfigError


@dataclass
class Line:
    """One verl key's fate, as printed and saved."""
    verl: str
    value: Any
    status: str                                   # translated | ignored | refused
    rlcore: dict[str, Any] = field(default_factory=dict)
    note: str = ""


def show(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def refusal(key: str, value: Any, why: str, closest: str) -> ConfigError:
    near = f"; closest rlcore setting: {closest}" if closest else ""
    return ConfigError(f"verl key {key!r} = {show(value)} is not supported: {why}{near}")

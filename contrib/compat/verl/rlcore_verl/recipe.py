"""A translation written as an rlcore YAML recipe, ready to edit: nested sections, each value with a comment naming
the verl key it came from, and the ignored keys listed (with why) as comments at the end."""
from __future__ import annotations

import json
from typing import Any

from rlcore_verl.keys import IGNORED
from rlcore_verl.translate import Translation

SECTION_ORDER = ("run", "model", "actor", "critic", "rollout", "agent", "task", "algorithm", "trainer")


def to_yaml(translation: Translation, title: str, notes: tuple[str, ...] = ()) -> str:
    origin: dict[str, list[str]] = {}
    for line in translation.lines:
        for key in line.rlcore:
            origin.setdefault(key, []).append(line.verl)
    tree: dict[str, Any] = {}
    for key, value in translation.overrides.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    out = [f"# {title}", *(f"# {note}" for note in notes),
           "# Translated from verl by `rlcore verl translate`; check it with `rlcore run --dry-run <this file>`."]
    for line in translation.lines:
        if "model.hf_config" in line.rlcore:
            out.append(f"# model.path: {line.value}   ({line.note})")
    ordered = sorted(tree, key=lambda s: SECTION_ORDER.index(s) if s in SECTION_ORDER else len(SECTION_ORDER))
    for section in ordered:
        _emit(out, section, tree[section], section, origin, 0)
    skipped = [line for line in translation.lines if line.status == IGNORED]
    if skipped:
        out.append("# verl keys with no effect in rlcore:")
        out += [f"#   {line.verl}={_scalar(line.value)}: {line.note}" for line in skipped]
    return "\n".join(out) + "\n"


def _emit(out: list[str], name: str, value: Any, path: str, origin: dict[str, list[str]], depth: int) -> None:
    pad = "  " * depth
    if isinstance(value, dict) and path not in origin:
        out.append(f"{pad}{name}:")
        for key, child in value.items():
            _emit(out, key, child, f"{path}.{key}", origin, depth + 1)
        return
    comment = f"  # {', '.join(dict.fromkeys(origin.get(path, [])))}" if path in origin else ""
    out.append(f"{pad}{name}: {_scalar(value)}{comment}")


def _scalar(value: Any) -> str:
    """A YAML flow value that reads back as the same Python value (floats keep a '.' so YAML 1.1 sees a float)."""
    if isinstance(value, float):
        text = repr(value)
        mantissa, _, exponent = text.partition("e")
        return f"{mantissa if '.' in mantissa else mantissa + '.0'}{'e' + exponent if exponent else ''}"
    return json.dumps(value)

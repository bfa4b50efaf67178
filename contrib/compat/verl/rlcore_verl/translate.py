"""Applying the translation table to verl overrides (``key=value`` as ``python3 -m verl.trainer.main_ppo`` takes
them). Every key ends up translated, ignored with a reason, or refused with a reason — none is dropped — and the
first refusal is one ``ConfigError`` line naming the key, the value, why, and the closest rlcore setting.

Hydra's prefixes: ``+key=`` and ``++key=`` (add/force a key) are read as ``key=``; ``~key`` (delete a verl default)
is listed as ignored, since rlcore does not start from verl's defaults."""
from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import yaml

from rlcore.errors import ConfigError
from rlcore_verl.groups import GROUPS
from rlcore_verl.keys import IGNORED, IMPLIED, REFUSED, TRANSLATED, Key, Refused, key_names, lookup
from rlcore_verl.lines import Line, refusal, show

# top-level sections only verl has; a key under them that the table lacks is an unknown verl key (reward_model is
# rlcore's too: a key there is verl's when the table has it or rlcore's schema lacks it)
VERL_SECTIONS = {"data", "actor_rollout_ref", "custom_reward_function", "ray_kwargs", "global_profiler",
                 "transfer_queue", "reward_manager"}


@dataclass
class Translation:
    lines: list[Line]
    overrides: dict[str, Any]                     # rlcore dotted key -> value

    def dotlist(self) -> list[str]:
        """The rlcore overrides as ``key=value`` strings ``load_config`` reads back exactly (JSON values)."""
        return [f"{k}={json.dumps(v)}" for k, v in self.overrides.items()]

    def table(self) -> str:
        """The translation as a fixed-width table, one line per verl key."""
        rows = [("verl key", "value", "rlcore")]
        for line in self.lines:
            if line.status == TRANSLATED:
                target = ", ".join(f"{k}={show(v)}" for k, v in line.rlcore.items()) or "(no key to set)"
                target += f"  ({line.note})" if line.note else ""
            else:
                target = f"{line.status}: {line.note}"
            rows.append((line.verl, show(line.value), target))
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        return "\n".join(f"{a:<{width[0]}}  {b:<{width[1]}}  {c}" for a, b, c in rows)

    def to_json(self) -> list[dict[str, Any]]:
        return [line.__dict__ for line in self.lines]


def parse_value(text: str) -> Any:
    """A Hydra override value as verl reads it: True/False/null, numbers (1e-6 too), [lists], quoted strings."""
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def split_override(item: str) -> tuple[str, str | None]:
    """``[+|++|~]key=value`` -> (key with its prefix, raw value or None for ``~key``)."""
    if item.startswith("~"):
        return item, None
    if "=" not in item:
        raise ConfigError(f"verl override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    return key, raw


def is_verl_key(key: str) -> bool:
    """In ``rlcore run --verl``: does this key belong to verl (translated) or to rlcore (passed on)?"""
    key = key.lstrip("+~")
    if lookup(key) is not None or key.split(".")[0] in VERL_SECTIONS:
        return True
    return not _is_rlcore_key(key)


def _is_rlcore_key(key: str) -> bool:
    from omegaconf import OmegaConf

    from rlcore.config.schema import Config

    top = key.split(".")[0]
    if top in ("algorithm", "agent"):            # plugin-owned: validated by the algorithm's / agent's dataclass
        return True
    schema = OmegaConf.structured(Config)
    parts = key.split(".")
    node: Any = schema
    for i, part in enumerate(parts):
        if not hasattr(node, "keys") or part not in node:
            return False
        if part in ("options", "rewards", "source_rewards", "template_kwargs") and i < len(parts) - 1:
            return True                          # free-form dicts
        node = node[part]
    return True


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, key_names(), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"unknown verl key {key!r}{hint}: it is not in rlcore's translation table "
                       f"(docs/coming-from-verl.md lists the keys)")


def translate(items: Sequence[str], model_families: Callable[[str], list[str]] | None = None) -> Translation:
    """verl ``key=value`` overrides -> rlcore overrides and one Line per key, in the order given. A refusal or an
    unknown key raises ConfigError (one line). ``model_families``: architecture -> the rlcore model families that
    serve it (``families_of(registry)``), to pick model.family from a checkpoint's config."""
    given: dict[str, Any] = {}
    lines: dict[str, Line] = {}
    order: list[str] = []
    for item in items:
        raw_key, raw = split_override(item)
        key = raw_key.lstrip("+~")
        if raw is None:
            lines[key] = Line(key, None, IGNORED, note="'~' deletes a verl default; rlcore does not start from "
                                                       "verl's defaults")
            order.append(key)
            continue
        row = lookup(key)
        if row is None:
            raise _unknown(key)
        given[key] = parse_value(raw)
        order.append(key)
    for key, (default, prefix) in IMPLIED.items():
        if key not in given and any(k.startswith(prefix) for k in given):
            row = lookup(key)
            assert row is not None and row.convert is not None
            lines[key] = Line(key, default, TRANSLATED, dict(zip(row.to, row.convert(default))),
                              "not given: verl's default")
            order.append(key)
    overrides: dict[str, Any] = {k: v for line in lines.values() for k, v in line.rlcore.items()}
    grouped: dict[str, dict[str, Any]] = {}
    for key, value in given.items():
        row = lookup(key)
        assert row is not None
        if row.group:
            grouped.setdefault(row.group, {})[key] = value
            continue
        lines[key] = _single(key, value, row)
        overrides.update(lines[key].rlcore)
    for group in (g for g in GROUPS if g in grouped):       # GROUPS' order: a later group reads an earlier one's
        for key, line in GROUPS[group](grouped[group], given, overrides, model_families).items():
            if line.status == REFUSED:
                raise refusal(key, line.value, line.note, _closest(key))
            lines[key] = line
            overrides.update(line.rlcore)
    return Translation([lines[k] for k in dict.fromkeys(order)], overrides)


def families_of(registry) -> Callable[[str], list[str]]:
    """architecture -> the model families registered for it."""
    return lambda arch: [name for name, spec in registry.models.items() if arch in spec.hf_architectures]


def _closest(key: str) -> str:
    row = lookup(key)
    return row.closest if row and row.closest else ", ".join(row.to) if row else ""


def _single(key: str, value: Any, row: Key) -> Line:
    if row.status == TRANSLATED:
        assert row.convert is not None
        try:
            values = row.convert(value)
        except Refused as e:
            raise refusal(key, value, e.why, e.closest or ", ".join(row.to)) from None
        return Line(key, value, TRANSLATED, dict(zip(row.to, values)))
    if row.accepts and value not in row.accepts:
        allowed = " or ".join(show(a) for a in row.accepts)
        raise refusal(key, value, f"{row.why} (only {allowed} has a counterpart)", row.closest)
    if row.status == REFUSED and not row.accepts:
        raise refusal(key, value, row.why, row.closest)
    why = row.why if row.status == IGNORED else f"{show(value)} is rlcore's behaviour too ({row.why})"
    return Line(key, value, IGNORED, note=why)

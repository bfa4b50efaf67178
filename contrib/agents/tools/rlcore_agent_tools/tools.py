"""Tools: an environment's documented methods as JSON-schema'd functions, and a tool's result as the text the model
sees (the tool calls read from a model's output: ``hermes``).

An environment is a plain class (as TRL's ``environment_factory``): ``reset(**row)`` plus public, type-hinted,
documented methods; each method is a tool whose schema comes from its signature and its docstring, so what the model
is told and what runs cannot drift apart. Everything the model gets wrong (bad JSON, an unknown argument, a wrong
type) becomes one line it reads back as the tool's answer, never an exception in the rollout.
"""
from __future__ import annotations

import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union

from rlcore.errors import PluginError

# Methods every environment may have that the agent calls itself; they are never offered to the model.
RESERVED_METHODS = frozenset({"reset", "reward", "close"})


@dataclass(frozen=True)
class Tool:
    """One function the model may call. ``parameters``: the JSON schema of its arguments (OpenAI's function
    "parameters"); ``call(**arguments)``: the bound method that runs it."""
    name: str
    description: str
    parameters: dict
    call: Callable[..., Any]

    def schema(self) -> dict:
        """The OpenAI tool schema, as chat templates take it in ``tools=``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check(self, arguments: dict) -> str:
        """"" if ``arguments`` fit the schema, else one line the model reads (the first problem found)."""
        if not isinstance(arguments, dict):
            return f"{self.name}: arguments must be a JSON object, got {json_type(arguments)}"
        properties = self.parameters.get("properties", {})
        for key in arguments:
            if key not in properties:
                takes = ", ".join(properties) or "no arguments"
                return f"{self.name}: unknown argument '{key}' (it takes {takes})"
        for key in self.parameters.get("required", []):
            if key not in arguments:
                return f"{self.name}: missing argument '{key}'"
        for key, value in arguments.items():
            problem = _mismatch(value, properties[key])
            if problem:
                return f"{self.name}: argument '{key}' {problem}"
        return ""


def environment_tools(env: object) -> dict[str, Tool]:
    """Every public method of ``env`` with type hints and a docstring is a tool (``reset``, ``reward``, ``close``
    and names starting with ``_`` are not); its schema comes from the signature (str/int/float/bool/list[...]/
    dict/Optional/Literal; a parameter with a default is not required) and the docstring (first paragraph = the
    description; Google-style ``Args:`` lines describe the parameters). An environment whose tools are not its
    methods (verl's tool configs) lists them itself in ``_rlcore_tools``.

    Raises PluginError (one line naming the class and method, and what to do) for a public method without a
    docstring or type hints, or with a parameter type no JSON schema here describes.
    """
    own = getattr(env, "_rlcore_tools", None)
    if own is not None:
        return dict(own)
    return {name: Tool(name, description, parameters, getattr(env, name))
            for name, description, parameters in _class_tools(type(env))}


_CLASS_TOOLS: dict[type, tuple[tuple[str, str, dict], ...]] = {}


def _class_tools(cls: type) -> tuple[tuple[str, str, dict], ...]:
    """(name, description, parameters) of each tool method of ``cls``, in definition order (base classes first).
    Kept per class: an environment is made for every episode, its class is read once."""
    if cls not in _CLASS_TOOLS:
        _CLASS_TOOLS[cls] = _read_class_tools(cls)
    return _CLASS_TOOLS[cls]


def _read_class_tools(cls: type) -> tuple[tuple[str, str, dict], ...]:
    names: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            names.update(dict.fromkeys(vars(klass)))
    tools = []
    for name in names:
        if name.startswith("_") or name in RESERVED_METHODS:
            continue
        attribute = inspect.getattr_static(cls, name)
        if isinstance(attribute, (staticmethod, classmethod)):
            attribute = attribute.__func__
        if inspect.isfunction(attribute):
            tools.append(_method_tool(cls, name, attribute))
    return tuple(tools)


def _method_tool(cls: type, name: str, function: Callable) -> tuple[str, str, dict]:
    where = f"environment {cls.__qualname__}: public method '{name}'"
    hide = f"or rename it '_{name}' to keep it from the model"
    doc = inspect.getdoc(function)
    if not doc:
        raise PluginError(f"{where} has no docstring; document it (its first paragraph is the tool's description "
                          f"the model reads, 'Args:' lines describe its arguments) {hide}")
    try:
        hints = typing.get_type_hints(function)
    except Exception as e:  # an annotation naming something not importable where the class is defined
        raise PluginError(f"{where} has type hints that cannot be resolved ({e}); fix them {hide}") from None
    description, documented = _parse_docstring(doc)
    properties: dict[str, dict] = {}
    required = []
    parameters = list(inspect.signature(function).parameters.values())
    if parameters and not isinstance(inspect.getattr_static(cls, name), staticmethod):
        parameters = parameters[1:]                     # self, or cls of a classmethod
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            stars = "**" if p.kind is p.VAR_KEYWORD else "*"
            raise PluginError(f"{where} takes {stars}{p.name}; a tool's arguments must be named, typed parameters "
                              f"{hide}")
        if p.name not in hints:
            raise PluginError(f"{where} has no type hint for '{p.name}'; annotate every parameter (str, int, float, "
                              f"bool, list[...], dict, Optional[...], Literal[...]) {hide}")
        try:
            schema = _json_schema(hints[p.name])
        except TypeError as e:
            raise PluginError(f"{where}: parameter '{p.name}' {e}; use str, int, float, bool, list[...], dict, "
                              f"Optional[...] or Literal[...]") from None
        if p.name in documented:
            schema["description"] = documented[p.name]
        properties[p.name] = schema
        if p.default is p.empty:
            required.append(p.name)
    stray = sorted(set(documented) - set(properties))
    if stray:
        raise PluginError(f"{where}: its docstring's Args describe '{stray[0]}', which it does not take; "
                          f"make the docstring match the signature")
    return name, description, {"type": "object", "properties": properties, "required": required}


_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _json_schema(hint: Any) -> dict:
    """The JSON schema of one parameter's type hint; TypeError (saying which type) for one it cannot describe."""
    if hint is Any:
        return {}
    if hint in _SCALARS:
        return {"type": _SCALARS[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in (list, tuple) or origin in (list, tuple):
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"has a fixed-length tuple type {hint}, which a JSON array cannot state")
        return {"type": "array", "items": _json_schema(args[0])} if args else {"type": "array"}
    if hint is dict or origin is dict:
        if args and args[0] is not str:
            raise TypeError(f"has type {hint}: JSON object keys are strings")
        return {"type": "object", "additionalProperties": _json_schema(args[1])} if args else {"type": "object"}
    if origin is Literal:
        types_ = {_SCALARS.get(type(a)) for a in args}
        if None in types_ or len(types_) != 1:
            raise TypeError(f"has {hint}: a Literal's values must be of one type among str, int, float, bool")
        return {"type": types_.pop(), "enum": list(args)}
    if origin in (Union, types.UnionType):
        schemas = [_json_schema(a) for a in args if a is not type(None)]
        nullable = len(schemas) < len(args)
        if len(schemas) == 1 and isinstance(schemas[0].get("type"), str):    # Optional[X]: X's schema, or null
            schema = {**schemas[0], "type": [schemas[0]["type"], "null"]}
            if "enum" in schema:
                schema["enum"] = [*schema["enum"], None]
            return schema
        if all(set(s) == {"type"} for s in schemas):
            return {"type": [s["type"] for s in schemas] + (["null"] if nullable else [])}
        return {"anyOf": schemas + ([{"type": "null"}] if nullable else [])}
    raise TypeError(f"has type {hint}, which has no JSON schema here")


_SECTION = re.compile(r"^(\w[\w ]*):\s*$")          # "Args:", "Returns:", "Raises:", "Example:" ...
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")   # "name (type): text" or "name: text"


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {argument: its description}) of a Google-style docstring: the description is the first
    paragraph (lines joined), the arguments are the entries of its "Args:" (or "Arguments:"/"Parameters:")
    section, continuation lines indented under their entry."""
    lines = doc.splitlines()
    first = []
    for line in lines:
        if not line.strip() or _SECTION.match(line.strip()):
            break
        first.append(line.strip())
    arguments: dict[str, str] = {}
    in_args, current, entry_indent = False, "", -1
    for line in lines:
        indent, text = len(line) - len(line.lstrip()), line.strip()
        section = _SECTION.match(line) if indent == 0 else None
        if section:
            in_args, current, entry_indent = section.group(1).lower() in ("args", "arguments", "parameters"), "", -1
            continue
        if not in_args or not text:
            continue
        if entry_indent < 0:
            entry_indent = indent
        entry = _ARG_LINE.match(text) if indent == entry_indent else None
        if entry:
            current = entry.group(1).lstrip("*")
            arguments[current] = entry.group(2).strip()
        elif current and indent > entry_indent:
            arguments[current] = (arguments[current] + " " + text).strip()
    return " ".join(first), arguments


def json_type(value: Any) -> str:
    """How the model would name the JSON type of a parsed value ("an integer", "a string", ...)."""
    for kind in ("boolean", "integer", "number", "string", "array", "object", "null"):
        if _FITS[kind](value):
            return _ARTICLE[kind]
    return type(value).__name__


_FITS: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


def _mismatch(value: Any, schema: dict) -> str:
    """"" if ``value`` fits ``schema`` (the subset of JSON schema tools use: type, enum, items, properties,
    required, additionalProperties, anyOf; other keywords are not checked), else what is wrong with it."""
    if not isinstance(schema, dict):
        return ""
    options = [o for o in schema.get("anyOf", []) if isinstance(o, dict)]
    if options:
        problems = [_mismatch(value, option) for option in options]
        if all(problems):
            typed = [p for o, p in zip(options, problems) if _kinds(o) and _fits_kind(value, _kinds(o))]
            return typed[0] if len(typed) == 1 else f"must be {_either(sum(map(_kinds, options), []))}, " \
                f"got {json_type(value)}"
    kinds = _kinds(schema)
    if kinds and not _fits_kind(value, kinds):
        return f"must be {_either(kinds)}, got {json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problem = _mismatch(item, schema["items"])
            if problem:
                return f"item {i} {problem}"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                return f"lacks key '{key}'"
        for key, item in value.items():
            sub = properties.get(key, schema.get("additionalProperties"))
            problem = _mismatch(item, sub) if isinstance(sub, dict) else ""
            if sub is False and key not in properties:
                problem = "is not allowed"
            if problem:
                return f"key '{key}' {problem}"
    return ""


def _kinds(schema: dict) -> list[str]:
    """The JSON types a schema names that can be checked here."""
    kinds = schema.get("type")
    return [k for k in ([kinds] if isinstance(kinds, str) else kinds or []) if k in _FITS]


def _fits_kind(value: Any, kinds: list[str]) -> bool:
    return any(_FITS[k](value) for k in kinds)


_ARTICLE = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
            "array": "an array", "object": "an object", "null": "null"}


def _either(kinds: list[str]) -> str:
    return " or ".join(_ARTICLE[k] for k in dict.fromkeys(kinds))


def tool_result_text(result: Any) -> str:
    """What the model reads of a tool's return value: a string as it is, a dict or list as JSON, None as "",
    anything else as ``str()``."""
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list)):
        return json.dumps(result, ensure_ascii=False, default=str)
    return str(result)

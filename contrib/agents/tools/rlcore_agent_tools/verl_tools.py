"""verl's multi-turn tool formats, read so a verl tool-using recipe runs in rlcore's tool agent unchanged: the
tool-config YAML (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) for native function tools, and each
row's ``extra_info.tools_kwargs``.

A verl tool is a ``BaseTool`` object shared by every episode, holding one episode's state under an instance id:
``create`` opens it (with the row's ``create_kwargs``), ``execute`` is one call, ``calc_reward`` scores the episode
and ``release`` frees it, all coroutines. ``VerlToolEnvironment`` maps that onto an rlcore environment (``reset``,
tools, ``reward``, ``close``). The coroutines of every verl tool run on one event loop of their own, in a thread, so
that what a tool creates in ``create`` (an HTTP session, a semaphore) is used in the loop it belongs to; the agent
awaits the calls without blocking its loop, and a call it times out is cancelled there.
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import threading
import types
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Iterable

import yaml

from rlcore.errors import ConfigError
from rlcore_agent_tools.specs import EnvironmentSpec
from rlcore_agent_tools.tools import Tool

TOOL_KEYS = ("class_name", "config", "tool_schema")
TOOLS_KWARGS_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")
BASE_TOOL_METHODS = ("create", "execute", "calc_reward", "release")
_NOT_READ = {
    "mcp": "MCP tools are not supported (their schemas come from a server at start-up); write the tool as a native "
           "BaseTool class (config.type: native) or as a method of an rlcore environment",
}


@dataclass(frozen=True)
class VerlFunctionTool:
    """One native function tool of a verl tool config: its OpenAI schema and the ``BaseTool`` object that runs it
    (one for every episode; each episode's state lives in the tool under its instance id)."""
    name: str
    description: str
    parameters: dict
    tool: Any
    class_name: str

    def schema(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def read_verl_tool_config(path: str) -> list[VerlFunctionTool]:
    """The tools of a verl tool-config YAML (``tools: [{class_name, config: {type: native, ...}, tool_schema}]``),
    each class imported from the user's environment and made as verl makes it: ``cls(config=config,
    tool_schema=schema)``. What rlcore does not run (``type: mcp``, an unknown key, a class that is not a verl
    ``BaseTool``) is a ConfigError naming the file, the tool and the key, and what to do."""
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"verl tool config {path!r} cannot be read: {e.strerror}; give the path of verl's "
                          f"tool-config YAML") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"verl tool config {path!r} is not YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(document, dict) or not isinstance(document.get("tools"), list):
        raise ConfigError(f"verl tool config {path!r} has no list 'tools' at its top; write "
                          f"'tools: [{{class_name: ..., config: {{type: native}}, tool_schema: ...}}]' as verl does")
    for key in document:
        if key != "tools":
            raise ConfigError(f"verl tool config {path!r}: top-level key {key!r} is not read (only 'tools'); "
                              f"remove it")
    tools = [_read_tool(path, i, entry) for i, entry in enumerate(document["tools"])]
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise ConfigError(f"verl tool config {path!r}: two tools are named {t.name!r}; give each tool_schema "
                              f"its own function.name")
        seen.add(t.name)
    return tools


def _read_tool(path: str, index: int, entry: Any) -> VerlFunctionTool:
    where = f"verl tool config {path!r}: tools[{index}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ConfigError(f"{where} has no 'class_name'; each tool is {{class_name: package.module.Class, config: "
                          f"{{type: native}}, tool_schema: ...}}")
    class_name = entry["class_name"]
    where = f"{where} ({class_name})"
    for key in entry:
        if key not in TOOL_KEYS:
            reason = _NOT_READ.get(key, f"rlcore reads {', '.join(TOOL_KEYS)}; remove it")
            raise ConfigError(f"{where}: key {key!r} is not supported: {reason}")
    config = entry.get("config")
    if not isinstance(config, dict) or "type" not in config:
        raise ConfigError(f"{where}: 'config' needs 'type: native' (verl's key for a function tool)")
    if config["type"] != "native":
        reason = _NOT_READ.get(str(config["type"]), "verl knows native and mcp, rlcore runs native")
        raise ConfigError(f"{where}: config.type={config['type']!r} is not supported: {reason}")
    cls = _import_class(where, class_name)
    schema = entry.get("tool_schema")
    if schema is not None:
        _check_schema(where, schema)
    try:
        tool = cls(config=config, tool_schema=_verl_schema(schema) if schema is not None else None)
    except Exception as e:
        raise ConfigError(f"{where}: {class_name}(config=..., tool_schema=...) raised {type(e).__name__}: {e}") \
            from None
    if schema is None:                     # verl's BaseTool falls back on the class's own schema
        schema = _as_dict(tool.get_openai_tool_schema()) if hasattr(tool, "get_openai_tool_schema") else None
        if schema is None:
            raise ConfigError(f"{where} has no 'tool_schema' and {class_name} gives none; write its tool_schema")
        _check_schema(where, schema)
    function = schema["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}, "required": []}
    return VerlFunctionTool(function["name"], function.get("description", ""), parameters, tool, class_name)


def _import_class(where: str, class_name: str) -> type:
    module_name, _, attribute = class_name.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attribute) if module_name else None
    except Exception as e:
        raise ConfigError(f"{where}: class_name {class_name!r} cannot be imported ({type(e).__name__}: {e}); "
                          f"install the package that defines it where rlcore runs") from None
    if not isinstance(cls, type):
        raise ConfigError(f"{where}: class_name {class_name!r} names no class; give package.module.Class")
    for method in BASE_TOOL_METHODS:
        if not inspect.iscoroutinefunction(getattr(cls, method, None)):
            raise ConfigError(f"{where}: {class_name} is not a verl BaseTool: it has no async method {method!r} "
                              f"(a BaseTool has async {', '.join(BASE_TOOL_METHODS)})")
    return cls


def _check_schema(where: str, schema: Any) -> None:
    """verl's OpenAIFunctionToolSchema: {type: function, function: {name, description, parameters}}."""
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(function, dict) or schema.get("type") != "function":
        raise ConfigError(f"{where}: tool_schema must be {{type: function, function: {{name, description, "
                          f"parameters}}}}")
    for key in schema:
        if key not in ("type", "function"):
            raise ConfigError(f"{where}: tool_schema key {key!r} is not read (only type, function); remove it")
    for key in function:
        if key not in ("name", "description", "parameters", "strict"):
            raise ConfigError(f"{where}: tool_schema.function key {key!r} is not read (name, description, "
                              f"parameters, strict); remove it")
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ConfigError(f"{where}: tool_schema.function.name is missing; name the function the model calls")
    parameters = function.get("parameters")
    if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type") != "object"
                                   or not isinstance(parameters.get("properties", {}), dict)):
        raise ConfigError(f"{where}: tool_schema.function.parameters must be {{type: object, properties: {{...}}, "
                          f"required: [...]}}")


def _verl_schema(schema: dict) -> Any:
    """The schema as the tool's constructor expects it: verl's pydantic OpenAIFunctionToolSchema where verl is
    installed (its BaseTool reads and prints it), else attribute access over the same fields."""
    try:
        from verl.tools.schemas import OpenAIFunctionToolSchema  # type: ignore[import-not-found]
    except ImportError:
        return _attributes(schema)
    return OpenAIFunctionToolSchema.model_validate(schema)


def _attributes(value: Any) -> Any:
    if isinstance(value, dict):
        return types.SimpleNamespace(**{k: _attributes(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_attributes(v) for v in value]
    return value


def _as_dict(schema: Any) -> Any:
    if schema is None or isinstance(schema, dict):
        return schema
    if hasattr(schema, "model_dump"):
        return schema.model_dump(exclude_none=True)
    if isinstance(schema, types.SimpleNamespace):
        return {k: _as_dict(v) for k, v in vars(schema).items()}
    return schema


@dataclass(frozen=True)
class ToolKwargs:
    """What one row gives one tool's create / execute / calc_reward / release (verl's ``tools_kwargs`` entry)."""
    create: dict = field(default_factory=dict)
    execute: dict = field(default_factory=dict)
    calc_reward: dict = field(default_factory=dict)
    release: dict = field(default_factory=dict)


def split_tools_kwargs(tools_kwargs: Any, tool_names: Iterable[str], where: str = "extra_info.tools_kwargs"
                       ) -> dict[str, ToolKwargs]:
    """Each tool's part of a row's ``tools_kwargs`` (``{tool: {"create_kwargs": {...}, "execute_kwargs": {...},
    "calc_reward_kwargs": {...}, "release_kwargs": {...}}}``); every tool in ``tool_names`` gets an entry, empty
    where the row names none. None stands for absent: a Parquet file's rows share one struct type, so a tool or key
    one row lacks reads back as None. A tool the config does not define, or an unknown key (a typo), is refused."""
    names = list(tool_names)
    split = {name: ToolKwargs() for name in names}
    if tools_kwargs is None:
        return split
    if not isinstance(tools_kwargs, dict):
        raise ConfigError(f"{where} must map tool names to {{create_kwargs: ..., execute_kwargs: ...}}, "
                          f"got {type(tools_kwargs).__name__}")
    for name, entry in tools_kwargs.items():
        if entry is None:
            continue
        if name not in split:
            raise ConfigError(f"{where} names tool {name!r}, which the tool config does not define (it defines "
                              f"{', '.join(names) or 'none'})")
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}.{name} must be a mapping of {', '.join(TOOLS_KWARGS_KEYS)}, "
                              f"got {type(entry).__name__}")
        parts = {}
        for key, value in entry.items():
            if key not in TOOLS_KWARGS_KEYS:
                raise ConfigError(f"{where}.{name}: key {key!r} is not one of verl's {', '.join(TOOLS_KWARGS_KEYS)}")
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{where}.{name}.{key} must be a mapping of keyword arguments, "
                                  f"got {type(value).__name__}")
            if value and ("instance_id" in value or key in value):
                raise ConfigError(f"{where}.{name}.{key} sets {'instance_id' if 'instance_id' in value else key!r}, "
                                  f"which rlcore passes itself; rename that argument")
            parts[key.removesuffix("_kwargs")] = _present(value or {})
        split[name] = ToolKwargs(**parts)
    return split


def _present(kwargs: dict) -> dict:
    """The keyword arguments without the None fields a Parquet struct adds for keys other rows have."""
    return {k: v for k, v in kwargs.items() if v is not None}


@functools.lru_cache(maxsize=1)
def _tool_loop() -> asyncio.AbstractEventLoop:
    """The event loop every verl tool coroutine of this process runs on (a daemon thread's)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="rlcore-verl-tools", daemon=True).start()
    return loop


def _run(coroutine: Coroutine) -> Any:
    """Run a tool coroutine on the tools' loop and wait for it (from any thread but that loop's)."""
    return asyncio.run_coroutine_threadsafe(coroutine, _tool_loop()).result()


class VerlToolEnvironment:
    """One episode with verl tools: ``reset`` creates an instance of every tool (the row's ``create_kwargs``),
    each tool call is an ``execute``, ``reward()`` is each tool's ``calc_reward`` (by tool name, as verl's
    ``reward_scores``), ``close()`` releases them. Tools are created as verl has called ``create``, both ways:
    its SGLang rollout passed the create_kwargs as keywords, its agent loop as ``create_kwargs=``."""

    def __init__(self, tools: list[VerlFunctionTool]):
        self._verl = {t.name: t for t in tools}
        self._rlcore_tools = {t.name: Tool(t.name, t.description, t.parameters, self._caller(t.name))
                              for t in tools}
        self._instances: dict[str, str] = {}
        self._kwargs: dict[str, ToolKwargs] = {}
        self.step_rewards: list[tuple[str, float]] = []    # what each execute returned as its step reward
        self.tool_metrics: list[tuple[str, dict]] = []

    def reset(self, **row: Any) -> None:
        tools_kwargs = row.get("tools_kwargs", (row.get("extra_info") or {}).get("tools_kwargs"))
        self._kwargs = split_tools_kwargs(tools_kwargs, self._verl)
        for name, verl in self._verl.items():
            create = self._kwargs[name].create
            extra = {"create_kwargs": create} if _takes(verl.tool.create, "create_kwargs") else {}
            created = _run(verl.tool.create(uuid.uuid4().hex, **create, **extra))
            self._instances[name] = created[0] if isinstance(created, tuple) else created
        return None

    def _caller(self, name: str) -> Callable[..., Any]:
        async def call(**arguments: Any) -> str:
            tool, instance = self._verl[name].tool, self._instances[name]
            future = asyncio.run_coroutine_threadsafe(
                tool.execute(instance, arguments, **self._kwargs[name].execute), _tool_loop())
            return self._response(name, await asyncio.wrap_future(future))
        call.__name__ = name
        return call

    def _response(self, name: str, returned: Any) -> str:
        """The text of what execute returned: (ToolResponse or str, step reward, metrics) in verl."""
        response = returned
        if isinstance(returned, tuple):
            response = returned[0]
            if len(returned) > 1 and isinstance(returned[1], (int, float)):
                self.step_rewards.append((name, float(returned[1])))
            if len(returned) > 2 and isinstance(returned[2], dict):
                self.tool_metrics.append((name, returned[2]))
        if getattr(response, "image", None) or getattr(response, "video", None):
            raise ValueError(f"verl tool {name!r} returned images or video; rlcore's tool agent reads text only")
        text = getattr(response, "text", response)
        return "" if text is None else str(text)

    def reward(self) -> dict[str, float]:
        return {name: float(_run(verl.tool.calc_reward(self._instances[name], **self._kwargs[name].calc_reward)))
                for name, verl in self._verl.items() if name in self._instances}

    def close(self) -> None:
        instances, self._instances = self._instances, {}
        for name, instance in instances.items():
            _run(self._verl[name].tool.release(instance, **self._kwargs[name].release))


def _takes(method: Callable, keyword: str) -> bool:
    parameters = inspect.signature(method).parameters.values()
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in parameters)


_CONFIGS: dict[str, list[VerlFunctionTool]] = {}


def make_verl_environment(options: dict) -> VerlToolEnvironment:
    """A fresh episode over the tools of ``agent.options.tool_config_path`` (verl's
    ``actor_rollout_ref.rollout.multi_turn.tool_config_path``). The file is read, and its tools made, once per
    process: as in verl, every episode shares the tool objects and keeps its state under its own instance ids."""
    for key in options:
        if key != "tool_config_path":
            raise ConfigError(f"agent.options.{key} is not read by the verl_tools environment (it reads "
                              f"tool_config_path)")
    if not options.get("tool_config_path"):
        raise ConfigError("agent.environment=verl_tools needs agent.options.tool_config_path: verl's tool-config "
                          "YAML (actor_rollout_ref.rollout.multi_turn.tool_config_path)")
    path = str(options["tool_config_path"])
    if path not in _CONFIGS:
        _CONFIGS[path] = read_verl_tool_config(path)
    return VerlToolEnvironment(_CONFIGS[path])


VERL_TOOLS = EnvironmentSpec("verl_tools", make_verl_environment,
                             "the function tools of a verl tool-config YAML (agent.options.tool_config_path), "
                             "with each row's extra_info.tools_kwargs")

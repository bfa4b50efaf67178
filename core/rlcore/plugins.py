"""Plugin manager: entry-point discovery (group ``rlcore``), ``--plugins`` selection, registry construction."""
from __future__ import annotations

import difflib
import importlib
import logging
from dataclasses import dataclass
from importlib import metadata

import pluggy

from rlcore import hookspecs
from rlcore.errors import PluginError
from rlcore.registry import KINDS, Registry

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rlcore"
BUILTIN_MODULES = ("rlcore_plugins.builtin",)


@dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str

    @property
    def label(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"


@dataclass
class LoadedPlugins:
    manager: pluggy.PluginManager
    registry: Registry
    plugins: list[PluginInfo]
    selection: list[str] | None = None   # what --plugins asked for (workers load the same set)

    @property
    def hook(self):
        return self.manager.hook

    def describe(self) -> list[dict]:
        """The resolved plugin set, as logged and stored with every run."""
        return [dict(name=p.name, distribution=p.distribution, version=p.version,
                     registers=self.registry.registered_by(p.label)) for p in self.plugins]


def installed_entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _info(name: str, ep: metadata.EntryPoint | None) -> PluginInfo:
    if ep is None or ep.dist is None:
        return PluginInfo(name, "rlcore", metadata.version("rlcore"))
    return PluginInfo(name, ep.dist.name, ep.dist.version)


def _import(name: str, ep: metadata.EntryPoint):
    try:
        return ep.load()
    except Exception as e:  # the plugin's own import failed: say which distribution and why
        info = _info(name, ep)
        raise PluginError(f"plugin {name!r} from {info.distribution} {info.version} failed to import "
                          f"({ep.value}): {type(e).__name__}: {e}") from e


def parse_selection(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise PluginError("--plugins is empty: give a comma-separated list such as --plugins=qwen3,grpo,vllm")
    return names


def _check_hook_names(pm: pluggy.PluginManager) -> None:
    """pluggy keeps a hookimpl that matches no hookspec as a hook nobody calls, so a misspelled name would silently
    do nothing; ``check_pending`` finds it, and this names the plugin, the hookimpl and the hook it probably meant."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        known = sorted(n for n, caller in vars(pm.hook).items() if not n.startswith("_") and caller.has_spec())
        unknown = [caller.name for caller in pm.get_hookcallers(e.plugin) or []
                   if not caller.has_spec() and any(i.plugin is e.plugin and not i.optionalhook
                                                    for i in caller.get_hookimpls())]
        raise PluginError(f"plugin {pm.get_name(e.plugin)}: " + "; ".join(
            f"hookimpl {name!r} matches no rlcore hook ({_did_you_mean(name, known)})" for name in unknown)
            + f". Rename it in {getattr(e.plugin, '__name__', e.plugin)}") from e


def _did_you_mean(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"rlcore's hooks: {', '.join(known)}"


def _declare_kinds(kinds: dict[str, str], declared: dict[str, str]) -> None:
    for kind, hook_name in declared.items():
        if kinds.get(kind, hook_name) != hook_name:
            raise PluginError(f"two registry kinds named {kind!r}: filled by {kinds[kind]!r} and {hook_name!r}")
        kinds[kind] = hook_name


def load_plugins(selected: list[str] | None = None) -> LoadedPlugins:
    """Load the built-ins plus the selected entry points (all installed ones when ``selected`` is None)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    kinds = dict(KINDS)           # + the kinds plugins declare with hookspecs of their own, as they register
    pm.hook.rlcore_add_hookspecs.call_historic(kwargs=dict(pluginmanager=pm),
                                               result_callback=lambda declared: _declare_kinds(kinds, declared))
    available = installed_entry_points()
    if selected is not None:
        unknown = [n for n in selected if n not in available]
        if unknown:
            listing = ", ".join(f"{n} ({_info(n, ep).distribution})" for n, ep in sorted(available.items())) or "none"
            raise PluginError(f"unknown plugin(s) {', '.join(map(repr, unknown))} in --plugins. Installed plugins: "
                              f"{listing}. Install the missing distribution (e.g. pip install rlcore-model-<name>).")
    chosen = [(n, ep) for n, ep in sorted(available.items()) if selected is None or n in selected]

    infos: list[PluginInfo] = []
    for module in BUILTIN_MODULES:
        info = _info("builtin", None)
        pm.register(importlib.import_module(module), name=info.label)
        infos.append(info)
    for name, ep in chosen:
        info = _info(name, ep)
        pm.register(_import(name, ep), name=info.label)
        infos.append(info)
    _check_hook_names(pm)

    registry = Registry()
    for kind, hook_name in kinds.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            for item in impl.function() or []:
                registry.add(kind, item, impl.plugin_name)
    log.info("plugins: %s", ", ".join(i.label for i in infos))
    return LoadedPlugins(pm, registry, infos, selected)

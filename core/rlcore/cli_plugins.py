"""The plugins a command line needs before argparse reads it: the commands and ``rlcore run`` flags that plugins add
(``rlcore_commands``, ``rlcore_run_dialects``) must be in the parser it builds."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.plugins import LoadedPlugins

# What the core's parser knows without plugins: its commands and `rlcore run`'s flags (argparse takes a flag's
# unambiguous prefix too). Commands and `rlcore run` flags of the project's published distributions are named when one
# is used without its distribution installed.
CORE_COMMANDS = ("run", "diagnose", "plugins", "dataset", "export", "convert")
RUN_FLAGS = ("--plugins", "--help-config", "--dry-run", "--resume")
PUBLISHED = {"verl": "rlcore-verl"}


def plugins_for(argv: list[str]) -> LoadedPlugins | None:
    """The plugins, loaded before the parser is built when ``argv`` may use what only a plugin adds (a command, a flag
    of ``rlcore run``, or the help listing them); None otherwise, since each command loads what it needs (``rlcore run
    --help-config`` stays quick). ``--plugins`` is read first, as pytest pre-parses ``-p``; a plugin's command or flag
    adds its installed plugin to that selection, so that naming it is enough."""
    command, rest = (argv[0], argv[1:]) if argv and not argv[0].startswith("-") else (None, argv)
    if command == "run":
        wanted = [("run_dialects", flag[2:]) for flag in (a.split("=", 1)[0] for a in rest if a.startswith("--"))
                  if len(flag) > 2 and not any(f.startswith(flag) for f in RUN_FLAGS)]
        if not wanted and "-h" not in rest and "--help" not in rest:
            return None
    elif command in CORE_COMMANDS:
        return None
    else:
        wanted = [("commands", command)] if command else []
    from rlcore.errors import PluginError
    from rlcore.plugins import load_plugins, parse_selection

    selection = parse_selection(_option(rest, "--plugins"))
    loaded = load_plugins(selection)
    missing = [(kind, name) for kind, name in wanted if not _provides(loaded, kind, name)]
    if missing and selection is not None:
        everything = load_plugins(None)
        plugin = {info.label: info.name for info in everything.plugins}
        extra = {plugin[everything.registry.owners[(kind, found)]]
                 for kind, name in missing for found in _provides(everything, kind, name)}
        if extra:
            loaded = load_plugins(selection + sorted(extra - set(selection)))
            missing = [(kind, name) for kind, name in missing if not _provides(loaded, kind, name)]
    for kind, name in missing:
        if name in PUBLISHED:
            what = f"--{name}" if kind == "run_dialects" else f"`rlcore {name}`"
            raise PluginError(f"{what} needs the {PUBLISHED[name]} distribution, which is not installed: pip install "
                              f"{PUBLISHED[name]}")
    for kind, taken in (("commands", CORE_COMMANDS), ("run_dialects", [f[2:] for f in RUN_FLAGS] + ["help"])):
        clash = sorted(set(getattr(loaded.registry, kind)) & set(taken))
        if clash:
            raise PluginError(f"{loaded.registry.owners[(kind, clash[0])]} registers the "
                              f"{kind[:-1].replace('_', ' ')} {clash[0]!r}, which is rlcore's own: rename it")
    return loaded


def _provides(loaded: LoadedPlugins, kind: str, name: str) -> list[str]:
    """The names of ``kind`` that ``name`` selects on the command line (a flag: by an unambiguous prefix too)."""
    return [n for n in getattr(loaded.registry, kind) if n == name or (kind == "run_dialects" and n.startswith(name))]


def _option(args: list[str], option: str) -> str | None:
    """The value of ``option`` (``--opt=value``, ``--opt value``, or by a prefix of its name) in ``args``."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if len(name) > 2 and option.startswith(name):
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None

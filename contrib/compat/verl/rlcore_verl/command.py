"""The command-line side: ``rlcore run --verl`` (verl overrides mixed with rlcore keys) and ``rlcore verl translate``
(a verl script -> an rlcore YAML recipe)."""
from __future__ import annotations

import json
import os
from typing import Sequence

from rlcore_verl.keys import IGNORED, TRANSLATED
from rlcore_verl.translate import Translation, families_of, is_verl_key, split_override, translate

SAVED_AS = ("verl_translation.txt", "verl_translation.json")


def run_overrides(items: Sequence[str], registry) -> tuple[list[str], Translation]:
    """``rlcore run --verl`` arguments -> rlcore overrides: verl keys translated, rlcore keys after them (so a key
    given in rlcore's own words wins), and the translation."""
    verl: list[str] = []
    rlcore: list[str] = []
    for item in items:
        key, _ = split_override(item) if "=" in item or item.startswith("~") else (item, None)
        (verl if is_verl_key(key) else rlcore).append(item)
    translation = translate(verl, families_of(registry))
    return translation.dotlist() + rlcore, translation


def summary(translation: Translation) -> str:
    counts = {s: sum(line.status == s for line in translation.lines) for s in (TRANSLATED, IGNORED)}
    return (f"verl keys: {len(translation.lines)} ({counts[TRANSLATED]} translated, {counts[IGNORED]} with no effect "
            f"in rlcore)\n{translation.table()}")


def save(translation: Translation, run_dir: str) -> None:
    """The translation next to the run's config: as printed, and as JSON."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, SAVED_AS[0]), "w", encoding="utf-8") as f:
        f.write(summary(translation) + "\n")
    with open(os.path.join(run_dir, SAVED_AS[1]), "w", encoding="utf-8") as f:
        json.dump(translation.to_json(), f, indent=1)


def translate_script(path: str, registry, env: dict[str, str] | None = None,
                     header: tuple[str, ...] = ()) -> tuple[str, Translation, list[str]]:
    """A verl script -> (rlcore YAML, translation, notes on what the shell reader did not run); ``header``: comment
    lines for the top of the YAML."""
    from rlcore.errors import ConfigError
    from rlcore_verl.recipe import to_yaml
    from rlcore_verl.script import read_script

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"verl script {path!r}: {e.strerror}") from None
    script = read_script(text, dict(os.environ) if env is None else env, source=path)
    translation = translate(script.overrides, families_of(registry))
    title = f"from {os.path.basename(path)} (verl --config-name={script.config_name})"
    return to_yaml(translation, title, header), translation, script.notes


def add_arguments(parser) -> None:
    """``rlcore verl``'s own subcommands."""
    sub = parser.add_subparsers(dest="verl_command", required=True)
    tr = sub.add_parser("translate", help="a verl example script (its main_ppo overrides, shell variables expanded) as "
                        "an rlcore YAML recipe, each value commented with its verl key")
    tr.add_argument("script")
    tr.add_argument("-o", "--out", help="write the YAML here (default: print it)")
    tr.add_argument("--plugins", help="the entry points to find model families in (default: every installed one)")


def run(args) -> int:
    """``rlcore verl <subcommand>``."""
    return {"translate": cmd_translate}[args.verl_command](args)


def cmd_translate(args) -> int:
    import sys

    from rlcore.plugins import load_plugins, parse_selection

    registry = load_plugins(parse_selection(args.plugins)).registry
    text, translation, notes = translate_script(args.script, registry)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        print(summary(translation))
        print(f"wrote {args.out}: check it with `rlcore run --dry-run {args.out}`")
    else:
        print(text, end="")
    return 0

"""The recipes in configs/ that are verl's Megatron examples translated: configs/verl-<script>.yaml, written by
`rlcore verl translate` from the scripts as verl publishes them (contrib/compat/verl/tests/data/verl/, each headed by
its source).

    python scripts/verl_recipes.py          # rewrite them
    python scripts/verl_recipes.py --check  # exit 1 if one differs from what the translation writes now

Paths under $HOME in the scripts are kept as ~/...; the Qwen3-30B script's validation file comes from a variable it
never sets ($aime24_test_path), given here as its own TEST_FILE. contrib/compat/verl/tests/test_verl_translate.py
checks them."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / "contrib" / "compat" / "verl" / "tests" / "data" / "verl"
CONFIGS = ROOT / "configs"
ENV = {"HOME": "~", "aime24_test_path": "~/verl/dataset/aime-2024.parquet"}


def recipes() -> dict[Path, str]:
    """configs/verl-<name>.yaml -> its text, for every script in SOURCES."""
    from rlcore.plugins import load_plugins
    from rlcore_verl.command import translate_script

    registry = load_plugins(["qwen3", "deepseek", "qwen2", "llama"]).registry
    out = {}
    for script in sorted(SOURCES.glob("*.sh")):
        first = script.read_text().splitlines()[0]
        source = first.removeprefix("# Source: ").removesuffix(", unchanged below this line")
        name = script.stem.removeprefix("run_").replace("_", "-")
        given = ", ".join(f"{k}={v}" for k, v in ENV.items() if k != "HOME")
        header = (f"Translated from {source}.",
                  f"Regenerate with `python scripts/verl_recipes.py` ($HOME as ~; {given}).",
                  f"Check it: rlcore run --dry-run verl-{name}. Train: set model.path (and the data files) first.")
        text, _, _ = translate_script(str(script), registry, env=ENV, header=header)
        out[CONFIGS / f"verl-{name}.yaml"] = text
    return out


def main(argv: list[str]) -> int:
    stale = []
    for path, text in recipes().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path.name)
        if "--check" not in argv:
            path.write_text(text)
    if stale:
        print(("stale: " if "--check" in argv else "wrote: ") + ", ".join(stale))
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

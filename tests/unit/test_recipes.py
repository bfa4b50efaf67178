"""configs/ holds every recipe once: the presets run by name and the bundled HF configs resolve to it, and no file of
it has a second copy anywhere in the repository (a copy would drift from the one users run). The built wheel carrying
the same files is tests/e2e/test_wheel_install.py's."""
import hashlib
import os
from collections import defaultdict
from importlib import resources
from pathlib import Path

from rlcore.config.loader import preset_names

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
RECIPE_SUFFIXES = (".yaml", ".yml", ".json")
NOT_THE_REPOSITORY = {".git", ".venv", "build", "dist", "runs", "__pycache__"}     # tools' and runs' outputs


def _repository_recipe_files():
    for folder, subfolders, files in os.walk(REPO):
        subfolders[:] = [d for d in subfolders
                         if d not in NOT_THE_REPOSITORY and not d.endswith((".egg-info", "_cache"))]
        yield from (Path(folder) / f for f in files if f.endswith(RECIPE_SUFFIXES))


def test_presets_are_the_files_in_configs():
    assert Path(str(resources.files("rlcore.presets"))).resolve() == CONFIGS
    assert preset_names() == sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert {"quickstart", "tool-calculator", "qwen2.5-7b-gsm8k-8gpu", "deepseek-v3-671b-96gpu"} <= set(preset_names())


def test_no_recipe_file_exists_twice():
    recipes = [p for p in CONFIGS.rglob("*") if p.suffix in RECIPE_SUFFIXES]
    assert len(recipes) > 20
    by_content = defaultdict(list)
    for path in _repository_recipe_files():
        by_content[hashlib.sha256(path.read_bytes()).hexdigest()].append(path.relative_to(REPO).as_posix())
    recipe_names = {p.name for p in recipes}
    same_name = sorted(p.relative_to(REPO).as_posix() for p in _repository_recipe_files()
                       if p.name in recipe_names and not p.is_relative_to(CONFIGS))
    copies = [sorted(paths) for paths in by_content.values() if len(paths) > 1 and any(
        path.startswith("configs/") for path in paths)]
    assert not copies, f"recipe files with the same bytes in two places (keep the one in configs/): {copies}"
    assert not same_name, f"files named like a recipe in configs/ outside it (keep the one in configs/): {same_name}"

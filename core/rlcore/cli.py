"""`rlcore run`, `rlcore train-rm`, `rlcore diagnose`, `rlcore plugins`, `rlcore dataset`, `rlcore export`,
`rlcore convert`, `rlcore scale`, and the
commands and `rlcore run` flags plugins add (``rlcore_commands``, ``rlcore_run_dialects``). User mistakes print one
line and exit 2; nothing else changes."""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from rlcore.cli_plugins import plugins_for


def _quiet_third_party() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _dest(dialect) -> str:
    """Where argparse keeps a dialect flag (apart from the core's own arguments)."""
    return "dialect_" + dialect.flag.replace("-", "_")


def cmd_run(args) -> int:
    if args.help_config:
        from rlcore.config import help_text

        print(help_text())
        return 0
    from rlcore.config import load_config
    from rlcore.errors import ConfigError
    from rlcore.plugins import load_plugins, parse_selection

    source, overrides = _split_args(args.args)
    plugins = args.loaded_plugins                  # loaded before parsing when a dialect flag was given
    dialects = [d for d in plugins.registry.run_dialects.values() if getattr(args, _dest(d))] if plugins else []
    translations = []
    if dialects:                                   # another framework's keys -> rlcore's, printed once
        if source is not None and source.startswith("~") and not os.path.exists(os.path.expanduser(source)):
            overrides, source = [source, *overrides], None          # hydra's ~key, not a file
        for dialect in dialects:
            overrides, translation = dialect.translate(overrides, plugins.registry)
            print(dialect.describe(translation))
            translations.append((dialect, translation))
    if args.resume:
        source, overrides = _resumed(args.resume, source, overrides)
    cfg = load_config(source, overrides)           # config errors surface before anything starts
    plugins = plugins or load_plugins(parse_selection(args.plugins))
    if args.dry_run:
        from rlcore.dry_run import command as dry_run

        return dry_run(cfg, plugins)
    import torch

    from rlcore import supervision
    from rlcore.checkpoint import how_to_resume, run_directory
    from rlcore.errors import WorkerDied
    from rlcore.run import Run

    torch.set_num_threads(1)
    for dialect, translation in translations:     # saved beside the run's config, so its directory is named now
        dialect.save(translation, run_directory(cfg))
    stop = supervision.StopRequest(cfg.trainer.stop_grace_s, lambda: supervision.grace_ran_out(cfg))
    stop.install()                                  # SIGTERM: stop after the step under way (rlcore.supervision)
    restarts = supervision.restarts_so_far()
    run = Run(cfg, plugins, stop, restarts)         # unknown families / algorithms / tasks surface here
    try:
        summary = run.train()
    except supervision.Stopped as e:
        run.close()
        _stop_ray()
        print(f"rlcore: stopped on SIGTERM after step {e.step}; {how_to_resume(run.run_dir)}", file=sys.stderr)
        stop.finished()
        return supervision.STOPPED_EXIT
    except WorkerDied as e:
        run.close()
        if supervision.may_restart(restarts, cfg.trainer.max_restarts, stop.requested):
            _stop_ray()
            supervision.restart_run(args.argv, args.started_env, run, str(e), restarts)
        raise WorkerDied(f"{e}; {how_to_resume(run.run_dir)}{supervision.budget_used(cfg.trainer.max_restarts)}") \
            from None
    finally:
        run.close()
    before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
    print(f"held-out accuracy (mean@{cfg.trainer.eval_n}): before RL {before:.3f}, after RL {after:.3f} "
          f"({after - before:+.3f})")
    for name, (before, after) in summary["eval_rewards"].items():
        print(f"  held-out {name}: before RL {before:.3f}, after RL {after:.3f} ({after - before:+.3f})")
    print(f"run directory: {summary['run_dir']} (metrics.jsonl, reward_curve.png, summary.json"
          f"{', hf/' if 'export' in summary else ''}{', adapter/' if 'adapter' in summary else ''})")
    return 0


def _resumed(run_dir: str, source: str | None, overrides: list[str]) -> tuple[str, list[str]]:
    """``--resume <run dir>``: the run's own config, then any overrides."""
    from rlcore.errors import ConfigError

    if source is not None:
        raise ConfigError(f"--resume {run_dir} continues that run with its own config: give key=value overrides "
                          f"only, not {source!r}")
    source = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(source):
        raise ConfigError(f"--resume {run_dir!r}: not a run directory (no config.yaml)")
    return source, [*overrides, f"run.dir={run_dir}", "trainer.resume=latest"]


def cmd_train_rm(args) -> int:
    import torch

    from rlcore.config import load_config
    from rlcore.plugins import load_plugins, parse_selection
    from rlcore.reward_training import RewardModelTraining

    source, overrides = _split_args(args.args)
    if args.resume:
        source, overrides = _resumed(args.resume, source, overrides)
    cfg = load_config(source, overrides)
    torch.set_num_threads(1)
    training = RewardModelTraining(cfg, load_plugins(parse_selection(args.plugins)))
    try:
        summary = training.train()
    finally:
        training.close()
    print(f"held-out pairwise accuracy ({summary['val_pairs']} pairs): before {summary['val_accuracy_before']:.3f}, "
          f"after {summary['val_accuracy_after']:.3f}")
    print(f"reward model: {summary['hf']} (score with it: rlcore run ... reward_model.path={summary['hf']})")
    return 0


def cmd_diagnose(args) -> int:
    from rlcore import diagnose
    from rlcore.dry_run import command as dry_run
    from rlcore.plugins import parse_selection

    source, overrides = _split_args(args.args)
    return diagnose.main(source, overrides, parse_selection(args.plugins), dry_run)


def cmd_plugins(args) -> int:
    from rlcore.plugins import load_plugins, parse_selection

    loaded = load_plugins(parse_selection(args.plugins))
    rows = loaded.describe()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['name']:<10} {row['distribution']} {row['version']}")
        for kind, names in sorted(row["registers"].items()):
            print(f"    {kind:<17} {', '.join(sorted(names))}")
    return 0


def cmd_dataset(args) -> int:
    from rlcore.datasets import export

    if args.kind == "gsm8k":
        path = export.write_parquet(export.gsm8k_rows(args.source, args.split), args.out)
        print(f"wrote {path}")
        return 0
    from omegaconf import OmegaConf

    from rlcore.errors import ConfigError
    from rlcore.plugins import load_plugins, parse_selection

    try:
        options = OmegaConf.to_container(OmegaConf.from_dotlist(args.options))
    except Exception as e:
        raise ConfigError(f"task options {args.options}: give key=value pairs ({e})") from e
    task = load_plugins(parse_selection(args.plugins)).registry.get("tasks", args.source).build(options, args.seed)
    source = f"rlcore/{args.source}"
    for name, rows in (("train", export.task_rows(task, source, args.train_size)),
                       ("val", export.task_rows(task, source, 0, held_out=True))):
        if rows:
            print(f"wrote {export.write_parquet(rows, os.path.join(args.out, f'{name}.parquet'))} ({len(rows)} rows)")
    return 0


def cmd_export(args) -> int:
    import torch

    from rlcore.errors import ConfigError
    from rlcore.export import export_checkpoint
    from rlcore.plugins import parse_selection

    torch.set_num_threads(1)
    if args.max_shard_gb <= 0:
        raise ConfigError(f"--max-shard-gb {args.max_shard_gb:g} must be > 0 (GB per safetensors file)")
    wrote = export_checkpoint(args.checkpoint, args.out, parse_selection(args.plugins), int(args.max_shard_gb * 1e9),
                              merged=args.merged, base=args.base)
    print(f"wrote {args.out} ({wrote})")
    return 0


def cmd_convert(args) -> int:
    from rlcore.hf_to_megatron import convert
    from rlcore.plugins import parse_selection

    out = convert(args.hf_dir, args.out, args.family, args.tp, args.pp, args.ep, args.dtype,
                  parse_selection(args.plugins))
    print(f"wrote {out}: start runs from it with model.path={out}")
    return 0


def cmd_scale(args) -> int:
    from rlcore.rollout.scaling import request_scale

    path = request_scale(args.run_dir, args.setting)
    print(f"wrote {path}: the run resizes at its next step (rollout/workers_alive, rollout/workers_added|removed)")
    return 0


def build_parser(loaded=None) -> argparse.ArgumentParser:
    """The core's commands, and the commands and ``rlcore run`` flags of ``loaded`` (plugins, when loaded)."""
    registry = loaded.registry if loaded is not None else None
    parser = argparse.ArgumentParser(prog="rlcore", description="RL post-training for LLMs: a core plus plugins.")
    parser.set_defaults(loaded_plugins=loaded)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train: rlcore run [--plugins=a,b] [config.yaml|preset] [key=value ...]")
    run.add_argument("--plugins", help="comma-separated entry points to load (default: every installed one)")
    run.add_argument("--help-config", action="store_true", help="print every config key with its default")
    run.add_argument("--dry-run", action="store_true", help="check the parallel layout against the model and "
                     "estimate memory per device and per node; starts nothing, needs no device")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its newest complete checkpoint, with "
                     "its config (key=value overrides still apply)")
    for dialect in registry.run_dialects.values() if registry else ():
        run.add_argument(f"--{dialect.flag}", action="store_true", dest=_dest(dialect), help=dialect.help)
    run.add_argument("args", nargs="*", help="a YAML file or preset name (default: quickstart), then key=value")
    run.set_defaults(func=cmd_run)
    rm = sub.add_parser("train-rm", help="train a scalar reward model on preference pairs (Bradley-Terry): rlcore "
                        "train-rm [--plugins=a,b] [config.yaml|preset] reward_training.train_files=[pairs.parquet]")
    rm.add_argument("--plugins", help="comma-separated entry points to load (default: every installed one)")
    rm.add_argument("--resume", metavar="RUN_DIR", help="continue from the run's newest complete checkpoint")
    rm.add_argument("args", nargs="*", help="a YAML file or preset name (default: quickstart), then key=value")
    rm.set_defaults(func=cmd_train_rm)
    for command in registry.commands.values() if registry else ():       # listed after `run`
        cmd = sub.add_parser(command.name, help=command.help)
        command.add_arguments(cmd)
        cmd.set_defaults(func=command.run)
    diag = sub.add_parser("diagnose", help="the installed stack against the tested versions, devices, plugins and "
                          "(given one) a config's checks and memory estimate: rlcore diagnose [config|preset] "
                          "[key=value ...]; exit status 1 if a problem would stop a run")
    diag.add_argument("--plugins", help="comma-separated entry points to load (default: every installed one)")
    diag.add_argument("args", nargs="*", help="a YAML file or preset name, then key=value")
    diag.set_defaults(func=cmd_diagnose)
    plug = sub.add_parser("plugins", help="list installed plugins and what each registers")
    plug.add_argument("--plugins", help="only these entry points")
    plug.add_argument("--json", action="store_true")
    plug.set_defaults(func=cmd_plugins)
    data = sub.add_parser("dataset", help="write prompt files in verl's Parquet schema: rlcore dataset gsm8k "
                          "train.jsonl train.parquet | rlcore dataset task addition out_dir [key=value ...]")
    data.add_argument("kind", choices=["gsm8k", "task"], help="gsm8k: GSM8K's public JSONL; task: a registered "
                      "task's prompts (train.parquet and val.parquet)")
    data.add_argument("source", help="the GSM8K .jsonl file, or the task's name")
    data.add_argument("out", help="the .parquet file (gsm8k) or directory (task) to write")
    data.add_argument("options", nargs="*", help="task: its options as key=value")
    data.add_argument("--split", default="train", help="gsm8k: the split named in extra_info (train or test)")
    data.add_argument("--train-size", type=int, default=5000, help="task: training prompts to write")
    data.add_argument("--seed", type=int, default=0, help="task: the seed its prompts are drawn with")
    data.add_argument("--plugins", help="task: the entry points to load it from (default: every installed one)")
    data.set_defaults(func=cmd_dataset)
    export = sub.add_parser("export", help="an HF checkpoint from a run checkpoint, or a LoRA run's PEFT adapter: "
                            "rlcore export <run dir>/checkpoints/step_<N> <out dir> [--merged]")
    export.add_argument("checkpoint")
    export.add_argument("out")
    export.add_argument("--merged", action="store_true", help="a LoRA checkpoint as the merged HF checkpoint "
                        "(W + B A * alpha/rank) instead of PEFT's adapter directory")
    export.add_argument("--base", metavar="HF_DIR", help="a LoRA checkpoint's base weights, where the directory the "
                        "run started from (recorded in the checkpoint) has moved")
    export.add_argument("--plugins", help="the entry points to load its model family from (default: every installed)")
    export.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="safetensors files of at most this many GB (10^9 bytes), with an index (default 5)")
    export.set_defaults(func=cmd_export)
    conv = sub.add_parser("convert", help="an HF checkpoint written once in Megatron's distributed format, which runs "
                          "start from (model.path=<out dir>), each rank reading its shard: rlcore convert <hf dir> "
                          "<out dir> --tp 8 --pp 4")
    conv.add_argument("hf_dir")
    conv.add_argument("out")
    for key, what in (("tp", "tensor"), ("pp", "pipeline"), ("ep", "expert")):
        conv.add_argument(f"--{key}", type=int, default=1, help=f"{what}-parallel size of the processes that write it")
    conv.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (the actor's actor.dtype)")
    conv.add_argument("--family", help="model plugin (default: the one registered for the checkpoint's architecture)")
    conv.add_argument("--plugins", help="the entry points to load its model family from (default: every installed)")
    conv.set_defaults(func=cmd_convert)
    scale = sub.add_parser("scale", help="add or remove rollout workers of a running async job: rlcore scale "
                           "<run dir> rollout=<n>")
    scale.add_argument("run_dir")
    scale.add_argument("setting", metavar="rollout=N")
    scale.set_defaults(func=cmd_scale)
    return parser


def main(argv: list[str] | None = None) -> int:
    started_env = dict(os.environ)                 # what a restart runs the command again in (rlcore.supervision)
    _quiet_third_party()
    from rlcore import logs
    from rlcore.errors import RlcoreError

    logs.configure()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        loaded = plugins_for(argv)                 # before parsing: the commands and flags plugins add
        parser = build_parser(loaded)
        args, extra = parser.parse_known_args(argv)
        if extra and args.command == "dataset" and all("=" in x and not x.startswith("-") for x in extra):
            args.options += extra                  # task options given after the flags
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.argv, args.started_env = argv, started_env
        return args.func(args)
    except RlcoreError as e:
        _stop_ray()
        print(f"rlcore: error: {e}", file=sys.stderr)
        return 2


def _stop_ray() -> None:
    """Stop Ray where this process started it: as it stops it prints what it still holds of the workers' output
    (lines it buffered to count repeats), which would otherwise come after the error line."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())

"""Registers verl compatibility with rlcore: the ``--verl`` flag of ``rlcore run`` and the ``rlcore verl`` command."""
from rlcore.hookspecs import hookimpl
from rlcore.specs import CommandSpec, DialectSpec
from rlcore_verl import command

VERL_COMMAND = CommandSpec(name="verl", help="coming from verl: rlcore verl translate <script.sh> [-o out.yaml]",
                           add_arguments=command.add_arguments, run=command.run)
VERL_DIALECT = DialectSpec(
    flag="verl", help="take verl's keys too (as verl.trainer.main_ppo takes them, +key= and ~key included), mixed "
    "with rlcore's: each translated, printed and saved in the run directory (verl_translation.txt), or refused in "
    "one line", translate=command.run_overrides, describe=command.summary, save=command.save)


@hookimpl
def rlcore_commands():
    return [VERL_COMMAND]


@hookimpl
def rlcore_run_dialects():
    return [VERL_DIALECT]

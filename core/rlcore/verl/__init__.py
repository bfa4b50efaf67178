"""verl compatibility: verl's configuration keys (``python3 -m verl.trainer.main_ppo`` overrides and example scripts)
translated into rlcore's. ``keys``: the translation table; ``translate``: applying it; ``script``: reading a verl
shell script; ``recipe``: writing the result as rlcore YAML; ``doc``: the table as Markdown."""

"""verl compatibility: verl's configuration keys (``python3 -m verl.trainer.main_ppo`` overrides and example scripts)
translated into rlcore's. ``keys``: the translation table; ``translate``: applying it (``lines``: one key's fate);
``groups``: keys read together; ``script``: reading a verl shell script; ``recipe``: writing the result as rlcore YAML;
``doc``: the table as Markdown; ``command`` and ``plugin``: ``rlcore run --verl`` and ``rlcore verl translate``."""

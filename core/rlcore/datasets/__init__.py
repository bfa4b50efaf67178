"""Prompt datasets from files: reading (Parquet, JSONL, JSON; verl's schema or a column mapping), and a seeded
per-epoch sampler whose position is part of the run state."""
from rlcore.datasets.files import Columns, PromptRecord, read_prompt_files
from rlcore.datasets.sampler import EpochSampler

__all__ = ["Columns", "EpochSampler", "PromptRecord", "read_prompt_files"]

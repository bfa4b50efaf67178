"""Prompt datasets from files: reading (Parquet, JSONL, JSON; verl's schema or a column mapping), rendering with a
chat template and filtering overlong prompts, and a seeded per-epoch sampler whose position is part of the run
state."""
from rlcore.datasets.files import Columns, PromptRecord, read_prompt_files
from rlcore.datasets.prompts import PromptRenderer, RenderedPrompt, render_and_filter
from rlcore.datasets.sampler import EpochSampler

__all__ = ["Columns", "EpochSampler", "PromptRecord", "PromptRenderer", "RenderedPrompt", "read_prompt_files",
           "render_and_filter"]

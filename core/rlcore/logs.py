"""What rlcore's processes print through logging: warnings, and the progress of loading a checkpoint (``rlcore.load``,
minutes at the presets' sizes). The CLI and every worker process call ``configure`` first."""
from __future__ import annotations

import logging


def configure() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rlcore.load").setLevel(logging.INFO)

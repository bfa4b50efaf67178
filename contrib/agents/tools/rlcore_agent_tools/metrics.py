"""A step's tool-use metrics from its trajectories' ``metadata["agent"]`` (``EpisodeStats``): per episode means and
maxima, counts summed, each tool's errors and timeouts by name. Nothing when the run's agent keeps no stats."""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from rlcore.trajectory import Trajectory, episodes_of


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    stats = [episode[0].metadata["agent"] for episode in episodes_of(trajectories)
             if "agent" in episode[0].metadata]
    if not stats:
        return {}
    n = len(stats)
    out = {"agent/turns_mean": sum(s["turns"] for s in stats) / n,
           "agent/turns_max": float(max(s["turns"] for s in stats)),
           "agent/tool_calls_mean": sum(s["tool_calls"] for s in stats) / n,
           "agent/tool_seconds": sum(s["tool_seconds"] for s in stats),
           "agent/observation_tokens_mean": sum(s["observation_tokens"] for s in stats) / n,
           "agent/truncated_results": float(sum(s["truncated_results"] for s in stats)),
           "agent/cut_by_budget": float(sum(s["cut_by_budget"] for s in stats)),
           "agent/split_samples": float(sum(s["split_samples"] for s in stats))}
    for kind in ("tool_errors", "tool_timeouts"):
        per_tool: Counter = sum((Counter(s[kind]) for s in stats), Counter())
        out[f"agent/{kind}"] = float(sum(per_tool.values()))
        out.update({f"agent/{kind}/{tool}": float(count) for tool, count in per_tool.items()})
    return out

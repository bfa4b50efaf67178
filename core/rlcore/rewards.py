"""Reward composition: several reward functions with weights, each component kept, failures counted not fatal.

A reward function (``RewardSpec.fn``) returns one float per response, or named components (a dict of lists) that
add up to its value. The composed reward is sum over functions of weight * value. When a function raises, it is
called again one response at a time so that only the responses it cannot score are marked failed (NaN), with the
reason; in strict mode the first failure stops the run instead. A function that knows which responses it cannot
score (a judge whose answer does not parse) returns an exception in place of each one's value, not raised: that
response alone is failed with it as the reason, and the function is not called again. A non-finite value fails its
response too. A ``RewardBroken`` error (a broken contract, a judge's engine gone) is fatal whatever the strictness.
"""
from __future__ import annotations

import importlib.util
import inspect
import math
import os
from collections import Counter
from dataclasses import dataclass, field

import torch

from rlcore.errors import ConfigError, RlcoreError
from rlcore.specs import RewardSpec


@dataclass
class Scores:
    total: torch.Tensor                                     # [N]; NaN where any component failed
    components: dict[str, torch.Tensor] = field(default_factory=dict)   # name -> [N] (unweighted; NaN = failed)
    reasons: Counter = field(default_factory=Counter)      # "reward: ErrorType: message" -> count

    @property
    def failed(self) -> torch.Tensor:
        return torch.isnan(self.total)

    def select(self, index: torch.Tensor) -> "Scores":
        return Scores(self.total[index], {n: v[index] for n, v in self.components.items()}, self.reasons)

    @staticmethod
    def cat(parts: list["Scores"]) -> "Scores":
        """The scores of several batches of responses, in order (failure reasons summed)."""
        names = {n for p in parts for n in p.components}
        nan = lambda p: torch.full_like(p.total, math.nan)  # noqa: E731  (a component this batch did not have)
        return Scores(torch.cat([p.total for p in parts]),
                      {n: torch.cat([p.components.get(n, nan(p)) for p in parts]) for n in names},
                      sum((p.reasons for p in parts), Counter()))

    def metrics(self) -> dict[str, float]:
        out = {"reward/failed": float(self.failed.sum())}
        for name, values in self.components.items():
            ok = values[~torch.isnan(values)]
            out[f"reward/{name}/mean"] = float(ok.mean()) if len(ok) else float("nan")
        return out


class RewardComposer:
    def __init__(self, rewards: list[tuple[RewardSpec, float]], strict: bool = False):
        self.rewards, self.strict = rewards, strict

    def __call__(self, responses: list[str], metadata: list[dict],
                 sequences: list[list[int]] | None = None) -> Scores:
        """``sequences``: each episode's tokens, for the rewards that read them (``RewardSpec.sequences``). A
        reward of weight 0 is logged, not added: a failure of it fails no sample."""
        scores = Scores(torch.zeros(len(responses), dtype=torch.float64))
        for spec, weight in self.rewards:
            components = self._components(spec, responses, metadata, sequences, scores.reasons)
            scores.components.update(components)
            if weight:
                scores.total += weight * sum(components.values())   # NaN propagates: the sample failed
        return scores

    def _components(self, spec: RewardSpec, responses, metadata, sequences, reasons: Counter
                    ) -> dict[str, torch.Tensor]:
        def call(rows: list[int] | None = None):
            pick = (lambda items: items) if rows is None else (lambda items: [items[i] for i in rows])  # noqa: E731
            if spec.sequences:
                if sequences is None:
                    raise RlcoreError(f"reward {spec.name!r} reads token sequences, which this caller does not give")
                return spec.fn(pick(responses), pick(metadata), pick(sequences))
            return spec.fn(pick(responses), pick(metadata))

        def failed(e: BaseException) -> None:
            if self.strict:
                raise RlcoreError(f"reward {spec.name!r} failed: {type(e).__name__}: {e} (task.strict_rewards is "
                                  f"set; unset it to count failed samples instead)") from e
            reasons[f"{spec.name}: {type(e).__name__}: {str(e)[:200]}"] += 1

        try:
            components, failures = _as_components(spec, call(), len(responses))
        except RewardBroken:
            raise
        except Exception as e:
            if self.strict:
                failed(e)
        else:
            for reason in failures.values():
                failed(reason)
            return components
        rows: list[dict[str, torch.Tensor] | None] = []   # isolate the responses it cannot score
        for i in range(len(responses)):
            try:
                row, failures = _as_components(spec, call([i]), 1)
            except RewardBroken:
                raise
            except Exception as e:
                row, failures = None, {0: e}
            for reason in failures.values():
                failed(reason)
            rows.append(row)
        names = next((list(r) for r in rows if r is not None), [spec.name])
        nan = torch.tensor([math.nan], dtype=torch.float64)
        return {n: torch.cat([r[n] if r is not None else nan for r in rows]) for n in names}


    def functions(self) -> "RewardComposer":
        """These rewards less those that read token sequences (reward models): what scores before their workers
        start (the warm start's held-out accuracy). Functions logged beside a reward model (weight 0) then weigh 1."""
        kept = [(spec, weight) for spec, weight in self.rewards if not spec.sequences]
        if not any(weight for _, weight in kept):
            kept = [(spec, 1.0) for spec, _ in kept]
        return RewardComposer(kept, self.strict)


class RewardBroken(RlcoreError):
    """A reward that cannot score at all, whichever the responses: fatal whatever the strictness (not retried, not
    counted as failed samples)."""


class WrongRewardShape(RewardBroken):
    """A reward function broke its contract (not one value per response)."""


def _as_components(spec: RewardSpec, out, n: int) -> tuple[dict[str, torch.Tensor], dict[int, BaseException]]:
    """The function's values as components (NaN where a response failed) and, per failed response, why: the
    exception it returned in place of the value, or a non-finite value's (the first component's, if several)."""
    named = {f"{spec.name}/{k}": v for k, v in out.items()} if isinstance(out, dict) else {spec.name: out}
    result: dict[str, torch.Tensor] = {}
    failures: dict[int, BaseException] = {}
    for name, values in named.items():
        values = list(values)
        if len(values) != n:
            raise WrongRewardShape(f"reward {spec.name!r} returned {len(values)} values for {n} responses: it must "
                                   f"return one per response")
        floats = []
        for i, v in enumerate(values):
            if isinstance(v, BaseException):
                failures.setdefault(i, v)
                floats.append(math.nan)
                continue
            floats.append(float(v))
            if not math.isfinite(floats[-1]):
                failures.setdefault(i, ValueError(f"non-finite reward {floats[-1]}"))
                floats[-1] = math.nan
        result[name] = torch.tensor(floats, dtype=torch.float64)
    return result, dict(sorted(failures.items()))


class SourceDispatch:
    """Each row scored by the reward of its ``data_source`` (a mixed dataset: GSM8K rows by ``gsm8k``, MATH rows by
    ``math``); a component is NaN on the rows of other sources, so its mean is over its own rows."""

    def __init__(self, by_source: dict[str, RewardComposer]):
        self.by_source = by_source

    def __call__(self, responses: list[str], metadata: list[dict],
                 sequences: list[list[int]] | None = None) -> Scores:
        n = len(responses)
        scores = Scores(torch.full((n,), math.nan, dtype=torch.float64))
        rows: dict[str, list[int]] = {}
        for i, meta in enumerate(metadata):
            rows.setdefault(meta.get("data_source", ""), []).append(i)
        for source, index in rows.items():
            if source not in self.by_source:
                raise RlcoreError(f"a sample has data_source {source!r}, which has no reward (sources with one: "
                                  f"{sorted(self.by_source)})")
            part = self.by_source[source]([responses[i] for i in index], [metadata[i] for i in index],
                                          None if sequences is None else [sequences[i] for i in index])
            at = torch.tensor(index, dtype=torch.long)
            scores.total[at] = part.total
            for name, values in part.components.items():
                scores.components.setdefault(name, torch.full((n,), math.nan, dtype=torch.float64))[at] = values
            scores.reasons.update(part.reasons)
        return scores


def functions_only(rewards: RewardComposer | SourceDispatch) -> RewardComposer | SourceDispatch:
    """``rewards`` less the reward models (``RewardComposer.functions``), per data source where it dispatches."""
    if isinstance(rewards, SourceDispatch):
        return SourceDispatch({source: c.functions() for source, c in rewards.by_source.items()})
    return rewards.functions()


def build_rewards(task_cfg, default_reward: str, data_sources: dict[str, int], registry, model_reward: str = ""
                  ) -> RewardComposer | SourceDispatch:
    """The run's reward from the ``task`` config section. ``task.rewards`` (weights), ``task.reward``,
    ``task.reward_fn`` or the task's default score every row alike; ``task.source_rewards`` maps data sources to
    rewards of their own. With neither a reward for every row nor a task default, each row is scored by the reward
    registered for its data source (``RewardSpec.data_sources``), and a source without one is refused here, before
    anything starts, naming the sources found and the rewards registered. ``model_reward``: the name a reward model
    is registered under; where ``task.rewards`` does not name it, it is the reward, and what would have been is
    logged beside it (weight 0: what the reward model is meant to stand for, to watch it being gamed)."""
    if task_cfg.reward_fn:
        file_reward = load_reward_file(task_cfg.reward_fn)
        registry.add("rewards", file_reward, owner=f"task.reward_fn={task_cfg.reward_fn}")
        default_reward = file_reward.name
    weights = dict(task_cfg.rewards) or ({task_cfg.reward or default_reward: 1.0}
                                         if task_cfg.reward or default_reward else {})
    if model_reward and model_reward not in weights and (task_cfg.rewards or task_cfg.reward):
        raise ConfigError(f"reward_model.path is set, but task.{'rewards' if task_cfg.rewards else 'reward'} does not "
                          f"name its reward {model_reward!r}: add it, e.g. task.rewards={{{model_reward}: 1.0, "
                          f"{next(iter(weights))}: 0.1}}, or leave task.reward(s) unset to train on it alone")
    monitor = bool(model_reward) and model_reward not in weights

    def compose(w: dict[str, float]) -> RewardComposer:
        if monitor:
            w = {model_reward: 1.0, **{name: 0.0 for name in w}}
        return RewardComposer([(registry.get("rewards", n), x) for n, x in w.items()], strict=task_cfg.strict_rewards)

    mapping = dict(task_cfg.source_rewards)
    if weights and not mapping:
        return compose(weights)
    for source, name in mapping.items():
        registry.get("rewards", name)                   # an unknown name is refused even if no row has the source
    by_source = {}
    for source in data_sources:
        if source in mapping:
            by_source[source] = compose({mapping[source]: 1.0})
        elif weights:
            by_source[source] = compose(weights)
        else:
            by_source[source] = compose({_registered_for(source, data_sources, registry): 1.0})
    return SourceDispatch(by_source)


def _registered_for(source: str, data_sources: dict[str, int], registry) -> str:
    claims = [r.name for r in registry.rewards.values() if source in r.data_sources]
    if len(claims) == 1:
        return claims[0]
    if claims:
        raise ConfigError(f"data_source {source!r} is claimed by several rewards ({', '.join(claims)}): choose one "
                          f"with task.source_rewards={{{source!r}: <reward>}}")
    found = ", ".join(f"{s or '(none)'} ({n} rows)" for s, n in sorted(data_sources.items()))
    registered = ", ".join(f"{r.name} ({', '.join(r.data_sources)})" if r.data_sources else r.name
                           for r in sorted(registry.rewards.values(), key=lambda r: r.name))
    what, key = (f"data_source {source!r}", source) if source else ("rows without a data_source", "''")
    raise ConfigError(f"no reward for {what}. Sources found: {found}. Rewards registered (with the sources they "
                      f"score): {registered}. Map it with task.source_rewards={{{key}: <reward>}}, or score every "
                      f"row with task.reward=<reward>")


def neutral_fill(rewards: torch.Tensor, failed: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Failed samples take the mean reward of their group's scored samples (0 if none), so they shift no other
    sample's group-relative advantage; their tokens are masked out of the loss by the caller."""
    rewards = rewards.clone()
    for g in torch.unique(group_ids[failed]):
        in_group = group_ids == g
        ok = in_group & ~failed
        rewards[in_group & failed] = rewards[ok].mean() if ok.any() else 0.0
    return rewards


def load_reward_file(target: str) -> RewardSpec:
    """A reward function from a Python file, ``path/to/file.py:function``, registered under the function's name.
    It takes rlcore's batched signature ``fn(responses, metadata) -> list[float]``, or verl's per-sample
    ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | {"score": ...}`` (the
    ground truth is ``metadata["answer"]``)."""
    path, _, name = target.rpartition(":")
    if not path or not name:
        raise ConfigError(f"task.reward_fn {target!r}: give path/to/file.py:function")
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise ConfigError(f"task.reward_fn: the file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"rlcore_reward_file_{abs(hash(path))}", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ConfigError(f"task.reward_fn: importing {path!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(n for n, v in vars(module).items()
                         if inspect.isfunction(v) and v.__module__ == module.__name__)
        raise ConfigError(f"task.reward_fn: {path!r} defines no function {name!r} (it defines: "
                          f"{', '.join(defined) or 'none'})")
    if "solution_str" in inspect.signature(fn).parameters:
        return RewardSpec(name, _per_sample(fn))
    return RewardSpec(name, fn)


def _per_sample(compute_score):
    """verl's per-sample reward signature, called once per response."""
    def batched(responses: list[str], metadata: list[dict]) -> list[float]:
        scores = []
        for response, meta in zip(responses, metadata):
            score = compute_score(data_source=meta.get("data_source", ""), solution_str=response,
                                  ground_truth=meta.get("answer"), extra_info=meta.get("extra_info"))
            scores.append(float(score["score"] if isinstance(score, dict) else score))
        return scores
    return batched

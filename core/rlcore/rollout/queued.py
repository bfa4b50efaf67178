"""The queued rollout source (``trainer.mode=async``): rollout workers of their own generate while the learner
trains. A producer (``rlcore.rollout.producer``: an asyncio loop on a thread of the driver) keeps groups in flight
on the rollout workers as far as admission allows (``rlcore.rollout.staleness``) and puts each finished group into
a buffer; the loop's ``next_groups`` takes a step's groups from it, scores them (on the driver's main thread, as the
colocated source does) and drops those the filter refuses, which gives their places back to the producer. After each
update the learner's weights are pushed to every rollout worker (``push_weights``).

Prompts are drawn as the colocated source draws a step's first round (draw d: ``task.train_prompts(d, batch)``,
seeded ``prompt_seeds(.., "train", d, 1)``) and a step's groups are put in draw order, so that with
``rollout.max_staleness=0`` a run samples and trains exactly what the colocated run does."""
from __future__ import annotations

import time
from typing import Callable, NoReturn

import torch

from rlcore.config import Config
from rlcore.data import Batch, build_sequences
from rlcore.errors import PEER_DEATH_WAIT_S, WorkerDied
from rlcore.multimodal import ImagePrompts
from rlcore.rewards import RewardComposer, Scores, SourceDispatch
from rlcore.rollout.groups import GroupFilter
from rlcore.rollout.handles import EngineWorkers, Weights
from rlcore.rollout.producer import Produced, Producer
from rlcore.rollout.source import Source, StepRollout
from rlcore.specs import Sampling, Task
from rlcore.timing import Timer
from rlcore.trajectory import Trajectory
from rlcore.weight_sync.logprob_check import (ProbeImages, compared, fixed_probe, probe_batch, raise_if_disagree,
                                              with_image_prompts, worst)


class QueuedSource(Source):
    def __init__(self, cfg: Config, rollout: EngineWorkers, task: Task, tokenizer, max_len: int,
                 rewards: RewardComposer | SourceDispatch, keep_group: Callable[[torch.Tensor], bool],
                 agent_metrics: Callable[[list[Trajectory]], dict[str, float]] | None = None,
                 images: ImagePrompts | None = None):
        super().__init__(cfg, task, tokenizer, max_len, rewards, keep_group, agent_metrics, images)
        self.rollout = rollout
        self.batch = cfg.trainer.prompts_per_step
        self.producer = Producer(cfg, rollout, task, self.encode_prompt, self.sampling(cfg.rollout.temperature))
        self.weights: Weights | None = None       # the learner's (its first push_weights opens the channel)
        # the weight version the engines hold (Learner.version, pushed): the model's own, or none
        self.pushed = -1 if any(w["weightless"] for w in rollout.where) else 0
        self.learner = (0, 0)                     # the learner's version, after this step
        self.trained_tokens = 0                   # response tokens of the batch the trainer took last
        self.last_take: float | None = None
        self.stats_asked: list = []               # the rollout workers' counters, asked for at the last take

    # --- what the loop asks for ----------------------------------------------------------------------------------
    def next_groups(self, step: int, version: int, timer: Timer) -> StepRollout:
        """``trainer.prompts_per_step`` groups the filter keeps, in draw order, taken as they come (at most
        ``rollout.max_sampling_rounds`` times that many looked at); every group sampled for the step is scored."""
        cfg = self.cfg
        self.producer.advance(step, version, self.pushed)     # the weights pushed so far are on the engines
        metrics: dict[str, float] = {}
        kept: list[Produced] = []
        sampled: list[tuple[tuple[int, int], Scores]] = []
        behind: list[int] = []
        wanted = GroupFilter(self.keep_group, self.batch)
        looked = stale = depth = 0
        waited_before = timer.seconds.get("wait", 0.0)
        while len(kept) < self.batch and looked < cfg.rollout.max_sampling_rounds * self.batch:
            with timer("wait"):
                produced, depth = self.producer.take()
            looked += 1
            lag = version - produced.version           # versions between the weights it started with and these
            if lag > cfg.rollout.max_staleness:        # a straggler past the bound: dropped, never trained on
                stale += 1
                self.producer.give_back()
                continue
            scores = self.scored([produced.group], timer)
            sampled.append(((produced.draw, produced.index), scores))
            if wanted.accepts(produced.group):
                kept.append(produced)
                behind.append(lag)
            else:
                self.producer.give_back()
        metrics.update(self._rates(timer.seconds["wait"] - waited_before))
        kept.sort(key=lambda p: (p.draw, p.index))
        for g, produced in enumerate(kept):
            for t in produced.group:
                t.group = g
        trajectories = [t for p in kept for t in p.group]
        self.trained_tokens = sum(sum(t.loss_mask) for t in trajectories)
        spans = [t.version[1] - t.version[0] for t in trajectories]
        metrics.update({"sampling/groups_dropped": float(wanted.dropped), "sampling/groups_kept": float(len(kept)),
                        "sampling/rounds": float(-(-looked // self.batch)),
                        "async/staleness_mean": sum(behind) / len(behind) if behind else 0.0,
                        "async/staleness_max": float(max(behind, default=0)), "async/stale_dropped": float(stale),
                        "async/queue_depth": float(depth),
                        "async/partial_frac": sum(s > 0 for s in spans) / len(spans) if spans else 0.0,
                        "async/partial_span_max": float(max(spans, default=0))})
        sampled.sort(key=lambda item: item[0])
        return StepRollout(trajectories, Scores.cat([s for _, s in sampled]) if sampled else Scores(torch.zeros(0)),
                           metrics)

    def _rates(self, waited: float) -> dict[str, float]:
        """Since the previous step's take: the share of the trainer's time spent waiting for groups; tokens/s on each
        side (the trainer's: the last batch's response tokens over its time not waiting); groups timed out. The
        rollout workers' counters (their time with nothing to generate or paused for a push, partial-rollout
        resumes) are one step behind: asked for at a take and read at the next, as a busy engine answers only
        between its steps (waiting for the answer cost the trainer ~70 ms a step on the quickstart)."""
        now = time.perf_counter()
        counts = self.producer.counted()
        engines = self._gather(self.stats_asked or self.rollout.stats())
        self.stats_asked = self.rollout.stats()
        metrics = {"async/groups_timed_out": float(counts["timed_out"]),
                   "async/resumed_requests": float(sum(e["resumed_requests"] for e in engines)),
                   "async/resumes_max": float(max(e["max_resumes"] for e in engines))}
        if self.last_take is not None:
            interval = now - self.last_take
            metrics.update({"async/trainer_idle_frac": waited / interval,
                            "async/rollout_idle_frac": sum(e["idle_s"] for e in engines)
                            / max(sum(e["interval_s"] for e in engines), 1e-9),
                            "async/rollout_tokens_per_s": counts["tokens"] / interval,
                            "async/trainer_tokens_per_s": self.trained_tokens / max(interval - waited, 1e-9)})
        self.last_take = now
        return metrics

    def _gather(self, refs: list) -> list:
        """The results of a call of the rollout workers; a worker's failure stops the run with one line naming it."""
        import ray

        results = []
        for index, ref in enumerate(refs):
            try:
                results.append(ray.get(ref))
            except Exception as e:
                self._worker_failed(index, e)
        return results

    def _worker_failed(self, index: int, error: BaseException) -> NoReturn:
        message = self.rollout.failed(index, error)
        self.producer.fail(message)
        raise WorkerDied(message) from None

    def _dead_receiver(self, refs: list) -> None:
        """After a failed push: a rollout worker that died during it, or failed to load it (the sender's error is then
        only its echo), stops the run with one line naming it. Receivers that only echo the channel's failure, or
        still wait for the push, are passed by."""
        import ray

        from rlcore.weight_sync.push import WeightPushError

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PEER_DEATH_WAIT_S)
        for index, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                except WeightPushError:
                    pass
                except Exception as e:
                    self._worker_failed(index, e)

    # --- weights -------------------------------------------------------------------------------------------------
    def push_weights(self, weights: Weights, version: int, step: int, timer: Timer | None = None) -> dict[str, float]:
        """After ``step`` the learner is at ``version``: its weights go to the rollout workers every
        ``rollout.sync_every`` steps, and at the first call (which opens the channel) if the engines hold others
        (started without weights; a resumed run's)."""
        metrics: dict[str, float] = {}
        first = self.weights is None
        if first:
            self._open_push(weights)
        self.weights, self.learner = weights, (version, step)
        if first or step % self.cfg.rollout.sync_every == 0:
            self._push(timer or Timer(), metrics)
        return metrics

    def _open_push(self, weights: Weights) -> None:
        """The channel from the learner's workers to every rollout worker."""
        import ray

        from rlcore.launch import free_port

        address = f"{ray.util.get_node_ip_address()}:{free_port()}"
        receivers = self.rollout.open_push(address)
        weights.open_push(address, self.rollout.world)
        self._gather(receivers)

    def _push(self, timer: Timer, metrics: dict) -> None:
        """Push the learner's weights to every rollout worker unless they hold them (each pauses its engine for the
        load); on ``trainer.check_logprobs_every`` steps the engines score a fixed probe with them, checked against
        the learner's."""
        version, step = self.learner
        weights = self.weights
        if version == self.pushed:
            return
        if weights is None:
            raise RuntimeError("the queued source has no weights to push: the loop hands them over (push_weights) "
                               "before it asks for episodes")
        every = self.cfg.trainer.check_logprobs_every
        checked = every and step % every == 0
        probe = None
        if checked:
            text = fixed_probe(len(self.tokenizer), seed=step, excluded=self.reserved_tokens)
            probe = (*text, None) if self.images is None else with_image_prompts(text, self.images, step)
        sequences = None if probe is None else ([p + r for p, r in zip(*probe[:2])], [len(p) for p in probe[0]],
                                                probe[2])
        with timer("sync"):
            received = self.rollout.receive_weights(sequences)
            try:
                sent = weights.push_weights(version)
            except Exception:
                self._dead_receiver(received)
                raise
            results = self._gather(received)
        self.pushed = version
        metrics.update(sent)
        metrics["sync/pause_seconds"] = max(r["pause_seconds"] for r in results)
        if probe is not None:
            metrics["check/logprob_max_diff"] = self._check(weights, probe, [r["scores"] for r in results])

    def _check(self, weights: Weights, probe: tuple[list[list[int]], list[list[int]], list[ProbeImages] | None],
               engines: list) -> float:
        """The largest |engine - actor| logprob over the probe's response tokens, on every rollout worker; raises
        past trainer.logprob_tolerance."""
        prompts, responses, images = probe
        pad = self.pad_id
        actor = weights.logprobs(probe_batch(prompts, responses, pad, images))
        result = worst(compared(actor, probe_batch(prompts, responses, pad, images, scores)) for scores in engines)
        raise_if_disagree(result, self.cfg.trainer.logprob_tolerance)
        return result.max_abs_diff

    def state_dict(self) -> dict:
        """The task's state before the first draw not wholly taken, and which groups of later draws were."""
        producer = self.producer.state_dict()
        return {"task": producer["task"], "producer": producer}

    def resumed(self, step: int, version: int, state: dict) -> None:
        """Admission goes on from the groups trained so far, rebased on the restored version (what was in flight
        when the run stopped is generated again, with the restored weights, which the next push_weights sends)."""
        self.producer.resumed(step, version, state.get("producer"))

    def sync(self) -> dict[str, float]:
        """Before an evaluation: the engines get the learner's weights if a push is still due (sync_every > 1)."""
        metrics: dict[str, float] = {}
        self._push(Timer(), metrics)
        return metrics

    # --- evaluation ------------------------------------------------------------------------------------------------
    def episodes(self, prompts: list[list[int]], metadata: list[dict], n: int, sampling: Sampling,
                 seeds: list[int]) -> list[list[Trajectory]]:
        """Split over the rollout workers, beside the groups the producer has in flight."""
        results = self._gather(self.rollout.episodes(prompts, metadata, n, sampling, seeds, "eval"))
        return [g for part in results for g in part]

    def close(self) -> None:
        """Cancel the producer's requests and stop its loop (before the rollout workers stop)."""
        self.producer.close()

"""The queued rollout source (``trainer.mode=async``): rollout workers of their own generate while the learner
trains. A producer (``rlcore.rollout.producer``: an asyncio loop on a thread of the driver) keeps groups in flight
on the rollout workers as far as admission allows (``rlcore.rollout.staleness``) and puts each finished group into
a buffer; the loop's ``next_groups`` takes a step's groups from it, scores them (on the driver's main thread, as the
colocated source does) and drops those the filter refuses, which gives their places back to the producer. After each
update the learner's weights are pushed to every rollout worker (``push_weights``). A rollout worker that dies is
healed (``rlcore.rollout.roster``): its groups start again elsewhere, its replacement joins at the next push (the
push channel is reopened whenever its members change); ``rlcore scale`` resizes it between steps.

Prompts are drawn as the colocated source draws a step's first round (draw d: ``task.train_prompts(d, batch)``,
seeded ``prompt_seeds(.., "train", d, 1)``) and a step's groups are put in draw order, so that with
``rollout.max_staleness=0`` a run samples and trains exactly what the colocated run does."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rlcore.config import Config
from rlcore.data import Batch, build_sequences
from rlcore.errors import PEER_DEATH_WAIT_S, WorkerDied
from rlcore.multimodal import ImagePrompts
from rlcore.rewards import RewardComposer, Scores, SourceDispatch
from rlcore.rollout.groups import GroupFilter
from rlcore.rollout.handles import EngineWorkers, Weights
from rlcore.rollout.producer import Produced, Producer
from rlcore.rollout.roster import Roster
from rlcore.rollout.scaling import ScaleRequests
from rlcore.rollout.source import Source, StepRollout
from rlcore.specs import Sampling, Task
from rlcore.timing import Timer
from rlcore.trajectory import Trajectory
from rlcore.weight_sync.logprob_check import engines_agree


class QueuedSource(Source):
    def __init__(self, cfg: Config, rollout: EngineWorkers, task: Task, tokenizer, max_len: int,
                 rewards: RewardComposer | SourceDispatch, keep_group: Callable[[torch.Tensor], bool],
                 agent_metrics: Callable[[list[Trajectory]], dict[str, float]] | None = None,
                 images: ImagePrompts | None = None):
        super().__init__(cfg, task, tokenizer, max_len, rewards, keep_group, agent_metrics, images)
        self.rollout = rollout
        self.batch = cfg.trainer.prompts_per_step
        self.roster = Roster(rollout, cfg.rollout.replace_dead)
        self.scale = ScaleRequests(cfg.run.dir)
        self.producer = Producer(cfg, rollout, self.roster, task, self.encode_prompt,
                                 self.sampling(cfg.rollout.temperature))
        self.weights: Weights | None = None       # the learner's (its first push_weights opens the channel)
        self.channel: list[tuple[int, int]] = []  # the rollout workers the push channel was opened with
        # the weight version the engines hold (Learner.version, pushed): the model's own, or none
        self.pushed = -1 if any(w["weightless"] for w in rollout.where) else 0
        self.landing: Landing | None = None       # a push the rollout workers are still loading
        self.learner = (0, 0)                     # the learner's version, after this step
        self.trained_tokens = 0                   # response tokens of the batch the trainer took last
        self.last_take: float | None = None
        self.stats_asked: tuple[list, list] = ([], [])   # the rollout workers' counters, asked for at the last take

    # --- what the loop asks for ----------------------------------------------------------------------------------
    def next_groups(self, step: int, version: int, timer: Timer) -> StepRollout:
        """``trainer.prompts_per_step`` groups the filter keeps, in draw order, taken as they come (at most
        ``rollout.max_sampling_rounds`` times that many looked at); every group sampled for the step is scored."""
        cfg = self.cfg
        size = self.scale.wanted()                            # rlcore scale: another number of rollout workers
        if size is not None:
            self.roster.resize(size)
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
                taken = self.producer.take()
            if taken is None:       # no worker serves; new ones wait for the weights
                self._push(timer, metrics)
                continue
            produced, depth = taken
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
        metrics.update(self.roster.metrics())
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
        if not self.stats_asked[0]:
            self.stats_asked = self._ask_stats()
        engines = list(self._gather(*self.stats_asked).values())
        self.stats_asked = self._ask_stats()
        metrics = {"async/groups_timed_out": float(counts["timed_out"]),
                   "async/resumed_requests": float(sum(e["resumed_requests"] for e in engines)),
                   "async/resumes_max": float(max((e["max_resumes"] for e in engines), default=0))}
        if self.last_take is not None and engines:
            interval = now - self.last_take
            metrics.update({"async/trainer_idle_frac": waited / interval,
                            "async/rollout_idle_frac": sum(e["idle_s"] for e in engines)
                            / max(sum(e["interval_s"] for e in engines), 1e-9),
                            "async/rollout_tokens_per_s": counts["tokens"] / interval,
                            "async/trainer_tokens_per_s": self.trained_tokens / max(interval - waited, 1e-9)})
        self.last_take = now
        return metrics

    def _ask_stats(self) -> tuple[list, list]:
        members = self.roster.serving()
        return members, self.rollout.stats([slot for slot, _ in members])

    def _gather(self, members: list[tuple[int, int]], refs: list) -> dict[int, Any]:
        """The results of a call of the rollout workers ``members`` (slot, generation), by slot. A worker that died
        is healed and left out; another failure stops the run with one line naming the worker."""
        import ray

        results = {}
        for (slot, generation), ref in zip(members, refs):
            try:
                results[slot] = ray.get(ref)
            except Exception as e:
                self._lost(slot, generation, e)
        return results

    def _lost(self, slot: int, generation: int, error: BaseException) -> None:
        stop = self.roster.lost(slot, generation, error)
        if stop is not None:
            self.producer.fail(stop)
            raise WorkerDied(stop) from None

    def _receivers_lost(self, members: list[tuple[int, int]], refs: list) -> bool:
        """After a failed push: whether a rollout worker died during it (healed: the push is tried again without it).
        One that failed to load it (the sender's error is then only its echo) stops the run with one line naming it.
        Receivers that only echo the channel's failure, or still wait for the push, are passed by."""
        import ray

        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PEER_DEATH_WAIT_S)
        return self._settle([m for m, r in zip(members, refs) if r in ready], [r for r in refs if r in ready])[1]

    def _settle(self, members: list[tuple[int, int]], refs: list) -> tuple[dict[int, Any], bool]:
        """The results of the rollout workers' loads of a push, by slot, and whether one of them died (healed). A load
        that failed with the push channel (an echo of another's death or of the sender's failure) is left out; any
        other failure stops the run with one line naming the worker."""
        import ray

        from rlcore.weight_sync.push import WeightPushError

        results, died = {}, False
        for (slot, generation), ref in zip(members, refs):
            try:
                results[slot] = ray.get(ref)
            except WeightPushError:
                pass
            except Exception as e:
                self._lost(slot, generation, e)
                died = True
        return results, died

    # --- weights -------------------------------------------------------------------------------------------------
    def push_weights(self, weights: Weights, version: int, step: int, timer: Timer | None = None) -> dict[str, float]:
        """After ``step`` the learner is at ``version``: its weights go to the rollout workers every
        ``rollout.sync_every`` steps, and at the first call (which opens the channel) if the engines hold others
        (started without weights; a resumed run's)."""
        metrics: dict[str, float] = {}
        first = self.weights is None
        self.weights, self.learner = weights, (version, step)
        if first or step % self.cfg.rollout.sync_every == 0 or self.roster.joining():
            self._push(timer or Timer(), metrics)
        return metrics

    def _open_push(self, weights: Weights, members: list[tuple[int, int]]) -> None:
        """The channel from the learner's workers to the rollout workers ``members``."""
        import ray

        from rlcore.launch import free_port

        address = f"{ray.util.get_node_ip_address()}:{free_port()}"
        receivers = self.rollout.open_push(address, [slot for slot, _ in members])
        weights.open_push(address, len(members))
        self._gather(members, receivers)
        self.channel = members

    def _push(self, timer: Timer, metrics: dict) -> None:
        """Push the learner's weights to every rollout worker unless they hold them (each pauses its engine for the
        load), and to every new one; on ``trainer.check_logprobs_every`` steps the engines score a fixed probe with
        them, checked against the learner's. A receiver that dies during the push is healed and the push tried again
        without it.

        With ``rollout.max_staleness`` >= 1 the learner does not wait for the engines to load (they pause, drain and
        load while it trains on the next batch, which was sampled before): the push lands at the next one, or before
        an evaluation. Groups started meanwhile wait for the load; the engines tag every sample with the version
        that made it, so the staleness bound holds whenever the load ends."""
        version, step = self.learner
        weights = self.weights
        with timer("sync"):
            again = self._land(metrics)
        if version == self.pushed and not again and not self.roster.joining():
            return
        if weights is None:
            raise RuntimeError("the queued source has no weights to push: the loop hands them over (push_weights) "
                               "before it asks for episodes")
        every = self.cfg.trainer.check_logprobs_every
        probe = self.probe(step) if every and step % every == 0 else None
        sequences = None if probe is None else ([p + r for p, r in zip(*probe[:2])], [len(p) for p in probe[0]],
                                                probe[2])
        with timer("sync"):
            while True:
                members = self._awaited(self.roster.members)
                if members != self.channel:
                    self._open_push(weights, members)
                    continue        # a member may have died while it opened
                received = self.rollout.receive_weights(sequences, [slot for slot, _ in members])
                try:
                    sent = weights.push_weights(version)
                except Exception:
                    if self._receivers_lost(members, received):
                        continue
                    raise
                if probe is None and self.cfg.rollout.max_staleness >= 1:
                    self.landing = Landing(members, received)
                    break
                results = self._gather(members, received)
                if results:         # else every receiver died after the sender was done: again, to the new ones
                    break
        if self.landing is None:
            self._landed(members, version, results, metrics)
        self.pushed = version
        metrics.update(sent)
        if probe is not None:
            scores = [r["scores"] for r in results.values()]
            metrics["check/logprob_max_diff"] = engines_agree(weights.logprobs, probe, scores, self.pad_id,
                                                              self.cfg.trainer.logprob_tolerance)

    def _land(self, metrics: dict) -> bool:
        """Wait for the push the rollout workers are still loading, if one is; whether it must be pushed again. A
        receiver that died meanwhile is healed (its replacement joins at the next push); the others then fail at the
        push's end, an echo of that death (their engines stay paused until a push succeeds), so it goes again."""
        landing, self.landing = self.landing, None
        if landing is None:
            return False
        results, _ = self._settle(landing.members, landing.received)
        self._landed([m for m in landing.members if m[0] in results], self.pushed, results, metrics)
        return len(results) < len(landing.members)

    def _landed(self, members: list[tuple[int, int]], version: int, results: dict[int, Any], metrics: dict) -> None:
        self.roster.pushed(members, version)
        if results:
            metrics["sync/pause_seconds"] = max(r["pause_seconds"] for r in results.values())

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
        """Split over the serving rollout workers, beside the groups the producer has in flight; the share of one that
        dies goes to the others."""
        groups: dict[int, list[Trajectory]] = {}
        pending = list(range(len(prompts)))
        while pending:
            members = self._serving()
            parts = [pending[w::len(members)] for w in range(len(members))]
            refs = [self.rollout.episodes(slot, [prompts[i] for i in part], [metadata[i] for i in part], n, sampling,
                                          [seeds[i] for i in part], f"eval{slot}")
                    for (slot, _), part in zip(members, parts)]
            results = self._gather(members, refs)
            for (slot, _), part in zip(members, parts):
                groups.update(zip(part, results.get(slot, [])))
            pending = [i for i in pending if i not in groups]
        return [groups[i] for i in range(len(prompts))]

    def _serving(self) -> list[tuple[int, int]]:
        """The serving rollout workers; while none serves, a replacement is waited for and pushed the weights."""
        while not (members := self._awaited(self.roster.serving, self.roster.joining)):
            self._push(Timer(), {})
        return members

    def _awaited(self, workers: Callable[[], list[tuple[int, int]]], enough: Callable[[], bool] = lambda: False
                 ) -> list[tuple[int, int]]:
        """``workers()`` once some are there, or [] once ``enough()``; meanwhile replacements start (the rollout side
        stopping raises its line)."""
        while not (members := workers()) and not enough():
            if self.producer.error is not None:
                raise WorkerDied(self.producer.error)
            time.sleep(0.1)
        return members

    def close(self) -> None:
        """Cancel the producer's requests and stop its loop (before the rollout workers stop); a push still loading
        is waited for (its failure no longer matters)."""
        self.producer.close()
        landing, self.landing = self.landing, None
        if landing is not None:
            import ray

            ray.wait(landing.received, num_returns=len(landing.received), timeout=PEER_DEATH_WAIT_S)


@dataclass
class Landing:
    """The last push (``QueuedSource.pushed``), handed over to the rollout workers ``members`` (slot, generation),
    their loads (``received``) still under way."""
    members: list[tuple[int, int]]
    received: list

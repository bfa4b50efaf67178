"""The actor's loss for one update, as every train worker composes it: the algorithm's policy loss over the old
policy's logprobs, the rollout correction, the entropy bonus, aggregated by the algorithm's mode and normalised by
the mini-batch's totals. Which logprobs are the old policy's is explicit per row (see ``ActorLoss``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlcore.config import Config
from rlcore.losses import aggregate, masked_mean
from rlcore.rollout_correction import correction, mismatch_metrics
from rlcore.specs import Algorithm


@dataclass
class ActorLoss:
    """``loss(logp, mb, entropy) -> (loss, metrics)`` for ``MegatronTrainable.train_step``.

    The old (proximal) policy's logprobs: the engine's (``actor.old_logprobs=rollout``); when the batch gets a single
    update, this pass's own forward, detached (the weights before the update: exact, and one forward saved);
    otherwise the batch's ``old_logprobs``, computed before the first update."""
    algorithm: Algorithm
    algo_cfg: Any
    cfg: Config
    total_tokens: float
    total_sequences: float
    single_update: bool

    def __call__(self, logp: torch.Tensor, mb, entropy: torch.Tensor) -> tuple[torch.Tensor, dict]:
        mask, rollout = mb["response_mask"], mb["rollout_logprobs"]
        if self.cfg.actor.old_logprobs == "rollout":   # the mismatch is measured to this pass's
            old, trainer = rollout, logp.detach()
        else:
            old = trainer = logp.detach() if self.single_update else mb["old_logprobs"]
        # the engine sampled with the old policy's weights: their logprobs should agree; the gap is always measured,
        # and corrected where the algorithm's rollout_is / rollout_rs_* ask: importance weights on the advantages (a
        # clipped surrogate is positively homogeneous in them, so this weights the surrogate and leaves a KL-in-loss
        # term alone, as verl does), rejected sequences out of the mask; the normalisers stay the mini-batch totals
        metrics = mismatch_metrics(trainer, rollout, mask)
        weights, kept, corrected = correction(old, rollout, mask, self.algo_cfg)
        advantages = mb["advantages"] if weights is None else mb["advantages"] * weights
        per_token, loss_metrics = self.algorithm.policy_loss(logp, old, advantages, kept,   # its metrics: kept tokens
                                                             mb["ref_logprobs"] if "ref_logprobs" in mb else None,
                                                             self.algo_cfg)
        metrics.update(loss_metrics)
        metrics.update(corrected)
        if self.cfg.actor.entropy_coef > 0:   # the bonus: higher entropy, lower loss
            per_token = per_token - self.cfg.actor.entropy_coef * entropy
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mask).item()
        metrics["rollout/logprob_diff_vs_actor"] = masked_mean((rollout - trainer).abs(), mask).item()
        mode = self.algorithm.loss_agg_mode(self.algo_cfg)
        return aggregate(per_token, kept, mode, self.total_tokens, self.total_sequences,
                         self.cfg.rollout.max_response_len), metrics

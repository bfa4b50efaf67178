"""The ranks that share one SGLang engine: the first holds it, the others receive its answers."""
from __future__ import annotations

from typing import Any, Awaitable

import torch


class Replica:
    """This rank's place among the ranks sharing one engine (``tp`` consecutive ranks of the trainer's world)."""

    def __init__(self, tp: int, distributed: bool):
        self.group = None
        self.leader = 0
        if distributed and tp > 1:
            import torch.distributed as dist

            rank, world = dist.get_rank(), dist.get_world_size()
            # new_group is collective: every rank creates every replica's group, in the same order
            groups = [dist.new_group(list(range(first, first + tp))) for first in range(0, world, tp)]
            self.group, self.leader = groups[rank // tp], rank - rank % tp
        self.leads = self.group is None or self.leader == torch.distributed.get_rank()
        self._arrived: dict[str, Any] = {}      # answers received before this rank asked for them

    def share(self, result: Any) -> Any:
        """The leader's ``result`` on every rank of the replica."""
        if self.group is None:
            return result
        box = [result]
        torch.distributed.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

    async def share_answer(self, request_id: str, answer: Awaitable | None) -> Any:
        """The leader's ``answer`` to request ``request_id`` (the others pass None) on every rank of the replica.

        Every rank issues the same requests, each once. The leader broadcasts each answer as it comes, in the order
        its requests finish; a rank waiting for an answer receives broadcasts until it has it, keeping those that
        came first for its requests still to be issued (an agent's next turn), so the ranks may issue in another
        order. The broadcasts block the event loop; a rank without the engine has nothing else to run meanwhile, and
        an error on the leader reaches every rank."""
        if self.group is None:
            return await answer if answer is not None else None
        if answer is not None:
            try:
                result = await answer
            except Exception as error:      # the others get a picklable account of it
                self.share((request_id, RuntimeError(f"the replica's engine failed: {type(error).__name__}: {error}")))
                raise
            self.share((request_id, result))
            return result
        while request_id not in self._arrived:
            answered, result = self.share(None)
            self._arrived[answered] = result
        result = self._arrived.pop(request_id)
        if isinstance(result, Exception):
            raise result
        return result

"""The train <-> rollout state machine: order of memory hand-off and when weights are pushed. A recording backend
stands in for the engine here because this is pure control logic; tests/integration/test_weight_sync.py uses real
vLLM."""
import torch

from rlcore.weight_sync.hybrid import HybridEngine
from rlcore.specs import RolloutBackend


class RecordingBackend(RolloutBackend):
    def __init__(self, can_release):
        self.can_release_memory = can_release
        self.calls, self.received = [], []

    async def generate(self, *a, **k): raise AssertionError("not used")
    def abort(self, request_id): raise AssertionError("not used")
    def score(self, *a, **k): raise AssertionError("not used")
    def update_weights(self, named, version):
        self.calls.append("update_weights")
        self.received = list(named)
        self.version = version
    def release_memory(self): self.calls.append("release_memory")
    def resume_memory(self, what): self.calls.append(f"resume_{what}")
    def stop(self): ...


class TinyActor:
    def __init__(self, calls=None):
        self.calls = calls if calls is not None else []
        self.updates = 0          # optimizer updates: the weights' version

    def offload(self, what): self.calls.append(f"offload_{what}")
    def onload(self, what): self.calls.append(f"onload_{what}")

    def hf_weights(self):
        yield "a", torch.zeros(2, 3)
        yield "b", torch.zeros(4, dtype=torch.bfloat16)


def test_order_with_a_backend_that_can_release_memory():
    backend = RecordingBackend(can_release=True)
    engine = HybridEngine(TinyActor(), backend)
    stats = engine.rollout_mode()
    assert backend.calls == ["resume_weights", "update_weights", "resume_kv_cache"]
    assert stats.bytes == 2 * 3 * 4 + 4 * 2 and stats.tensors == 2
    assert engine.rollout_mode() is None, "already in rollout mode: nothing happens"
    engine.train_mode()
    assert backend.calls[-1] == "release_memory"


def test_weights_are_pushed_only_when_stale():
    backend, actor = RecordingBackend(can_release=False), TinyActor()
    engine = HybridEngine(actor, backend)
    engine.rollout_mode()
    engine.train_mode()
    assert engine.rollout_mode() is None and backend.calls == ["update_weights"]
    engine.train_mode()
    actor.updates += 1        # an optimizer step
    assert engine.rollout_mode() is not None and backend.calls == ["update_weights", "update_weights"]
    assert backend.version == engine.version == 1, "the engine holds the actor's version after a push"
    assert "release_memory" not in backend.calls, "a backend that cannot release memory is never asked to"


def test_full_order_with_every_offload_switch():
    """rollout: optimizer, grads out -> engine weights in -> push -> params out -> KV cache in; train: the reverse."""
    from types import SimpleNamespace

    backend = RecordingBackend(can_release=True)
    actor = TinyActor(backend.calls)         # one shared log of actor and engine calls
    engine = HybridEngine(actor, backend, offload=SimpleNamespace(params=True, grads=True, optimizer=True))
    engine.rollout_mode()
    assert backend.calls == ["offload_optimizer", "offload_grads", "resume_weights", "update_weights",
                             "offload_params", "resume_kv_cache"]
    backend.calls.clear()
    engine.train_mode()
    assert backend.calls == ["release_memory", "onload_params", "onload_grads", "onload_optimizer"]


def test_the_engine_check_reads_the_actor_with_its_params_on_the_device():
    """In rollout mode with offloaded params, the engine check's actor pass gets them back for its duration (it read
    storage of size 0 before: 'setStorage ... size 0'); in train mode they are on the device already."""
    from types import SimpleNamespace

    backend = RecordingBackend(can_release=False)
    actor = TinyActor(backend.calls)
    engine = HybridEngine(actor, backend, offload=SimpleNamespace(params=True, grads=False, optimizer=False))
    with engine.actor_params_on_device():
        assert backend.calls == [], "train mode: nothing moves"
    engine.rollout_mode()
    backend.calls.clear()
    with engine.actor_params_on_device():
        assert backend.calls == ["onload_params"]
    assert backend.calls == ["onload_params", "offload_params"]

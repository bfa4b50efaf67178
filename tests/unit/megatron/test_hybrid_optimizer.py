"""``actor.optim.name=hybrid_adam``: megatron-core's hybrid CPU/GPU optimizer trains the quickstart's model with the
same updates as ``adam``, bit for bit, at offload fractions 0.5 and 1.0, fp32 and bf16; its state goes through a
checkpoint and the resumed updates are the uninterrupted ones (from and to ``adam`` too); it holds on the host what
``--dry-run`` (``rlcore.sizing``) says it does; its settings are checked before anything starts."""
import dataclasses

import pytest
import torch

from rlcore.config import load_config
from rlcore.data import Batch, build_sequences
from rlcore.errors import ConfigError
from rlcore.losses import aggregate
from rlcore.megatron.actor import MegatronActor
from rlcore.plugins import load_plugins
from rlcore.sizing import estimate, offloaded_elements, optimizer_bytes

STEPS = 4


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart's model (its task's tokenizer, ``model.tiny`` sizes) and supervised batches of its task."""
    from transformers import AutoTokenizer

    registry = load_plugins(["qwen3"]).registry
    cfg = load_config("quickstart", [])
    task = registry.get("tasks", cfg.task.name).build(dict(cfg.task.options), 0)
    directory = str(tmp_path_factory.mktemp("tokenizer"))
    vocab = task.write_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    spec = registry.get("models", cfg.model.family)
    hf = spec.tiny_hf_config(vocab_size=vocab, **dataclasses.asdict(cfg.model.tiny))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    batches = []
    for step in range(STEPS):
        examples = task.supervised_examples(step, 16)
        batches.append(Batch(build_sequences([encode(p) for p, _ in examples],
                                             [encode(c) + [eos] for _, c in examples], pad_id=eos)))
    return registry, spec, hf, batches


def build(quickstart, *overrides):
    registry, spec, hf, _ = quickstart
    cfg = load_config("quickstart", list(overrides))
    optimizer = registry.get("optimizers", cfg.actor.optim.name)
    optimizer.check(cfg.actor.optim, "actor.optim")
    return cfg, MegatronActor(spec, hf, cfg.actor, optimizer, seed=0)


def train(quickstart, *overrides, actor=None, batches=slice(None)):
    """Losses of STEPS updates (or of ``batches``) with the quickstart's optimizer settings, and the trained actor
    (built, unless given)."""
    actor = actor or build(quickstart, *overrides)[1]
    losses = []
    for batch in quickstart[3][batches]:
        tokens = float(batch["response_mask"].sum())

        def nll(logp, mb):
            share = aggregate(-logp, mb["response_mask"], "token-mean", tokens, len(batch))
            return share, {"loss": float((-logp * mb["response_mask"]).sum())}

        losses.append(actor.train_step(batch, nll)["loss"])
    return losses, actor


def distributed(actor):
    """The actor's one megatron-core DistributedOptimizer (``adam``'s comes in a ChainedOptimizer of one)."""
    chained = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    assert len(chained) == 1
    return chained[0]


def adam_states(actor) -> dict:
    """Each parameter's fp32 main copy and Adam moments, as the distributed optimizer reports them."""
    return {name: {k: v for k, v in distributed(actor)._get_main_param_and_optimizer_states(p).items()
                   if k in ("param", "exp_avg", "exp_avg_sq")}
            for name, p in actor.model.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hybrid_adam_trains_exactly_as_adam(quickstart, dtype):
    expected, plain = train(quickstart, f"actor.dtype={dtype}")
    assert expected[-1] < expected[0], expected
    for fraction in (0.5, 1.0):
        losses, hybrid = train(quickstart, f"actor.dtype={dtype}", "actor.optim.name=hybrid_adam",
                               f"actor.optim.offload_fraction={fraction}")
        inner = distributed(hybrid).optimizer
        assert type(inner).__name__ == "HybridDeviceOptimizer" and inner.cpu_optimizers
        assert (inner.gpu_optimizer is None) == (fraction == 1.0)
        assert losses == expected, (fraction, losses, expected)
        for (name, a), b in zip(plain.model.named_parameters(), hybrid.model.parameters()):
            assert torch.equal(a, b), (fraction, name)
        hybrid_states = adam_states(hybrid)
        for name, states in adam_states(plain).items():
            for key, value in states.items():
                assert torch.equal(value, hybrid_states[name][key]), (fraction, name, key)


@pytest.mark.parametrize("dtype, saved, resumed", [
    ("float32", 0.5, 0.5), ("bfloat16", 0.5, 0.5), ("bfloat16", 1.0, 0.0), ("bfloat16", 0.0, 1.0)])
def test_checkpoint_round_trip(quickstart, tmp_path, dtype, saved, resumed):
    """Saved after two updates with one offload fraction (0: ``adam``), loaded into a fresh actor with another: the
    same optimizer state, and the next updates are the uninterrupted run's, bit for bit."""
    from rlcore.megatron.checkpoint import load_model, save_model

    def settings(fraction):
        name = "hybrid_adam" if fraction else "adam"
        return f"actor.dtype={dtype}", f"actor.optim.name={name}", f"actor.optim.offload_fraction={fraction}"

    _, actor = train(quickstart, *settings(saved), batches=slice(2))
    assert save_model(actor, str(tmp_path / "model"))
    states = {n: {k: v.clone() for k, v in s.items()} for n, s in adam_states(actor).items()}
    expected, _ = train(quickstart, actor=actor, batches=slice(2, None))
    _, fresh = build(quickstart, *settings(resumed))
    load_model(fresh, str(tmp_path / "model"))
    loaded = adam_states(fresh)
    for name, tensors in states.items():
        for key, value in tensors.items():
            assert torch.equal(value, loaded[name][key]), (name, key)
    assert train(quickstart, actor=fresh, batches=slice(2, None))[0] == expected


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def states(optimizer) -> list:
    """A torch optimizer's state tensors (not its 0-dim step counters)."""
    return [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]


def measured_bytes(actor) -> tuple[int, int, int, int, int]:
    """(device bytes, host bytes, shard elements, bf16 ones, offloaded ones) of the optimizer the plugin built,
    read off its tensors: on this CPU machine the hybrid optimizer's "host" ones are those of its host
    sub-optimizers, every other optimizer tensor is what a GPU would hold. Tensors sharing storage with Megatron
    DDP's parameter and gradient buffers (fp32 main params of an fp32 model, main grads) are the model's."""
    inner = distributed(actor).optimizer
    owned = {t.untyped_storage().data_ptr() for b in actor.ddp.buffers for t in (b.param_data, b.grad_data)}
    shard = [p for group in inner.param_groups for p in group["params"]]    # the distributed optimizer's main params
    device = _bytes(p for p in shard if p.untyped_storage().data_ptr() not in owned)
    bf16 = sum(p.numel() for group in distributed(actor).shard_fp32_from_float16_groups for p in group)
    numel = sum(p.numel() for p in shard)
    if type(inner).__name__ != "HybridDeviceOptimizer":
        return device + _bytes(states(inner)), 0, numel, bf16, 0
    host_params = [p for o in inner.cpu_optimizers for g in o.param_groups for p in g["params"]]
    on_device = states(inner.gpu_optimizer) if inner.gpu_optimizer else []
    host_states = [t for o in inner.cpu_optimizers for t in states(o)
                   if all(t is not p for p in host_params)]          # master_param is the host copy itself
    host = _bytes(host_params) + _bytes(p.grad for p in host_params) + _bytes(host_states)
    device += _bytes(t for t in on_device if all(t is not p for p in shard))
    return device, host, numel, bf16, sum(p.numel() for p in host_params)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name, fraction", [("adam", 0.0), ("hybrid_adam", 0.5), ("hybrid_adam", 1.0)])
def test_dry_run_split_is_what_the_plugin_builds(quickstart, dtype, name, fraction):
    from rlcore.megatron.model import transformer_config

    overrides = [f"actor.dtype={dtype}", f"actor.optim.name={name}", f"actor.optim.offload_fraction={fraction}"]
    cfg, actor = build(quickstart, *overrides)
    actor.train_step(quickstart[3][0], lambda lp, mb: (lp.sum() * 0.0, {}))   # Adam's state exists after a step
    device, host, numel, bf16, offloaded = measured_bytes(actor)
    largest = max(p.numel() for g in distributed(actor).optimizer.param_groups for p in g["params"])
    estimated = offloaded_elements(numel, fraction)
    assert estimated <= offloaded < estimated + largest
    assert (bf16 > 0) == (dtype == "bfloat16")
    assert (device, host) == optimizer_bytes(numel, bf16, offloaded)
    # --dry-run's numbers for this model: the same, but for the part of a parameter moved past the fraction, and
    # for the fp32 norms of a bf16 model, which it counts as bf16
    _, spec, hf, _ = quickstart
    plan = estimate(transformer_config(spec, hf, dtype), hf, cfg)
    assert plan["total_params"] == numel
    fp32_norms = numel - bf16 if dtype == "bfloat16" else 0
    assert plan["per_device"]["optimizer"] - device == pytest.approx((offloaded - estimated) * 8 + fp32_norms * 4)
    assert host - plan["cpu_per_node_training"] == pytest.approx((offloaded - estimated) * 16)


@pytest.mark.parametrize("overrides, expected", [
    (["actor.optim.offload_fraction=0.5"],
     r"actor.optim.offload_fraction = 0.5 needs the hybrid CPU/GPU optimizer: set actor.optim.name=hybrid_adam"),
    (["actor.optim.name=hybrid_adam"],
     r"actor.optim.name = hybrid_adam with actor.optim.offload_fraction = 0 keeps all optimizer state on the device"),
    (["algorithm.name=ppo", "critic.optim.offload_fraction=1"],
     r"critic.optim.offload_fraction = 1 needs the hybrid CPU/GPU optimizer: set critic.optim.name=hybrid_adam"),
])
def test_offload_fraction_belongs_to_hybrid_adam(overrides, expected):
    """Refused before any worker starts, naming the key, its value and the fix."""
    from rlcore.run import Run

    with pytest.raises(ConfigError, match=expected):
        Run(load_config("quickstart", overrides), load_plugins(["qwen3", "grpo", "ppo", "vllm"]))

"""Every CPU shim is still needed: without it, building and training a tiny model on CPU fails; with all of them,
it trains. Each case runs in a fresh process because the shims patch megatron-core process-wide."""
import subprocess
import sys
import textwrap

import pytest

from rlcore.megatron import cpu

SCRIPT = textwrap.dedent("""
    import sys, torch
    from rlcore.megatron import cpu
    for name in sys.argv[1:]:
        cpu.SHIMS.pop(name)
    from rlcore.config.schema import ActorConfig
    from rlcore.data import Batch, build_sequences
    from rlcore.losses import aggregate
    from rlcore.megatron.actor import MegatronActor
    from rlcore_model_qwen3.plugin import QWEN3
    from rlcore_plugins.optimizers import SPECS
    hf = QWEN3.tiny_hf_config(vocab_size=16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                              head_dim=16, ffn_hidden_size=64, max_position_embeddings=16)
    actor = MegatronActor(QWEN3, hf, ActorConfig(micro_batch_size=2), SPECS[0])
    batch = Batch(build_sequences([[1, 2, 3]] * 4, [[4, 5]] * 4, pad_id=0))
    losses = [actor.train_step(batch, lambda lp, mb: (aggregate(-lp, mb["response_mask"], "token-mean", 8.0, 4),
                                                      {"loss": float(-(lp * mb["response_mask"]).sum() / 4)}))["loss"]
              for _ in range(3)]
    assert losses[-1] < losses[0], losses
    print("TRAINED", losses)
""")


def run(*skip):
    return subprocess.run([sys.executable, "-c", SCRIPT, *skip], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_all_shims_train_on_cpu():
    result = run()
    assert result.returncode == 0 and "TRAINED" in result.stdout, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("shim", sorted(cpu.SHIMS))
def test_each_shim_is_still_needed(shim):
    result = run(shim)
    assert result.returncode != 0, f"megatron-core trained on CPU without shim {shim!r}: remove the shim"

"""`--dry-run`'s per-device model state (``rlcore.sizing.estimate``) against what the built actor really holds after
an optimizer step: the distinct storages of Megatron DDP's parameter and gradient buffers and of the optimizer's
state and main params (``_memory``, what offload moves) on each of 2 ranks (gloo), for a dense Qwen3 at TP2 in bf16
(an fp32 master copy), a Qwen3-MoE at EP2 and an MLA model (DeepSeek-V3) at TP2 x EP2 (sequence parallel, which
megatron-core asks of MoE with TP). Within 10% each, and in total (measured: within 0.2%)."""
import pytest

from ranks import run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.parallel]

KINDS = ("params", "grads", "optimizer")
CASES = ("dense-tp2-bf16", "moe-ep2", "mla-tp2-ep2")

RANK_SCRIPT = """
import os, sys, torch, torch.distributed as dist
torch.set_num_threads(1)
from megatron.core import parallel_state as mpu
from safetensors.torch import save_file
from rlcore.config.schema import ActorConfig, Config, ParallelConfig, TrainerConfig
from rlcore.data import Batch, build_sequences
from rlcore.megatron.actor import MegatronActor
from rlcore.megatron.model import transformer_config
from rlcore.megatron.parallel import shutdown_parallel
from rlcore.sizing import estimate
from rlcore_model_deepseek.plugin import DEEPSEEK_V3
from rlcore_model_qwen3.plugin import QWEN3, QWEN3_MOE
from rlcore_plugins.optimizers import SPECS

KINDS = ("params", "grads", "optimizer")
SIZES = dict(vocab_size=2048, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
             ffn_hidden_size=512, max_position_embeddings=64)
CASES = {"dense-tp2-bf16": (QWEN3, dict(tp=2), "bfloat16"), "moe-ep2": (QWEN3_MOE, dict(ep=2), "float32"),
         "mla-tp2-ep2": (DEEPSEEK_V3, dict(tp=2, ep=2, sp=True), "float32")}


def held(actor) -> list[int]:
    # bytes of the distinct storages behind each kind (a storage shared with an earlier kind counts there)
    seen, sizes = set(), []
    for kind in KINDS:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in actor._memory(kind)}
        sizes.append(sum(n for ptr, n in storages.items() if ptr not in seen))
        seen |= storages.keys()
    return sizes


rows = {}
for name, (spec, layout, dtype) in CASES.items():
    hf = spec.tiny_hf_config(**SIZES)
    cfg = Config(actor=ActorConfig(micro_batch_size=4, dtype=dtype, parallel=ParallelConfig(**layout)),
                 trainer=TrainerConfig(world_size=int(os.environ["WORLD_SIZE"])))
    actor = MegatronActor(spec, hf, cfg.actor, SPECS[0])
    batch = Batch(build_sequences([[1, 2, 3]] * 4, [[4, 5]] * 4, pad_id=0))
    actor.train_step(batch, lambda lp, mb: (lp.sum() * 0.0, {}))      # Adam's state exists after a step
    planned = estimate(transformer_config(spec, hf, dtype), hf, cfg)["per_device"]
    mine = torch.tensor([held(actor), [planned[k] for k in KINDS]], dtype=torch.float64)
    both = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(both, mine)
    rows[name] = torch.stack(both)      # [rank, measured | estimated, kind]
    del actor
    mpu.destroy_model_parallel()        # the next case builds its own groups on the same processes
if dist.get_rank() == 0:
    save_file(rows, sys.argv[1])
shutdown_parallel()
"""


def test_dry_run_model_state_is_what_the_actor_holds(tmp_path):
    rows = run_ranks(RANK_SCRIPT, tmp_path, 2, tmp_path / "bytes.safetensors")
    for case in CASES:
        for rank, (measured, estimated) in enumerate(rows[case].tolist()):
            line = "  ".join(f"{k} {m / 2**20:.2f}/{e / 2**20:.2f}" for k, m, e in zip(KINDS, measured, estimated))
            print(f"{case} rank {rank} MiB measured/estimated: {line}; total {sum(estimated) / sum(measured):.3f}x")
            for kind, m, e in zip(KINDS, measured, estimated):
                assert abs(e - m) <= 0.1 * m, (case, rank, kind, m, e)
            assert abs(sum(estimated) - sum(measured)) <= 0.1 * sum(measured), (case, rank)

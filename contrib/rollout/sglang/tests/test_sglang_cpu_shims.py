"""Each CPU shim is still needed: without it SGLang (0.5.23, from PyPI, on the CPU torch) fails to import, and with it
the same import works. Each case runs in a fresh interpreter, as SGLang's spawned processes do. Skipped where SGLang
is not installed or where torch has CUDA."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if importlib.util.find_spec("sglang") is None or torch.cuda.is_available():
    pytest.skip("SGLang on CPU is not installed here (contrib/rollout/sglang/requirements-sglang.txt)",
                allow_module_level=True)


def run(code: str, skip: str = "", cpu_engine: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLCORE_SGLANG_CPU_SHIMS_SKIP": skip}
    # what an engine started earlier in this session (cpu.enable) left in the environment
    for name in ("SGLANG_CPU_OMP_THREADS_BIND", "RLCORE_SGLANG_CPU_SHIMS", "SGLANG_USE_CPU_ENGINE"):
        env.pop(name, None)
    if cpu_engine:
        env.update(RLCORE_SGLANG_CPU_SHIMS="1", SGLANG_USE_CPU_ENGINE="1")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_pth_installs_the_import_hook_at_startup():
    result = run("import sys; print([type(f).__name__ for f in sys.meta_path][0])", cpu_engine=False)
    assert result.stdout.strip() == "CpuShimFinder", result.stderr


def test_torchvision_op_schemas_still_needed():
    from rlcore_rollout_sglang import cpu

    if not cpu.cuda_built_torchvision_on_cpu_torch():
        pytest.skip("torchvision here is not a CUDA build on the CPU torch")
    code = "import torchvision.transforms; print('ok')"
    without = run(code, skip="torchvision_op_schemas", cpu_engine=False)
    assert without.returncode != 0 and "operator torchvision::nms does not exist" in without.stderr
    assert run(code, cpu_engine=False).stdout.strip() == "ok"
    # transformers' model classes import torchvision wherever it is installed: broken without the shim, too
    code = "from transformers import Qwen3ForCausalLM; print('ok')"
    assert run(code, skip="torchvision_op_schemas", cpu_engine=False).returncode != 0
    assert run(code, cpu_engine=False).stdout.strip() == "ok"


def test_sgl_kernel_stand_in_still_needed():
    code = "import sglang.srt.mem_cache.allocation, sgl_kernel; print(sgl_kernel.__version__)"
    without = run(code, skip="sgl_kernel_stand_in")
    assert without.returncode != 0 and "No module named 'sgl_kernel'" in without.stderr
    assert run(code).stdout.strip().endswith("rlcore.cpu.stand.in")
    # the stand-in is served only to processes that asked for SGLang's CPU engine
    assert "No module named 'sgl_kernel'" in run("import sgl_kernel", cpu_engine=False).stderr


GATE_PROBE = """import torch
from {module} import fused_gate_sigmoid_mul_add
torch.manual_seed(0)
hidden, gate_weight, shared, routed = torch.randn(5, 16), torch.randn(16), torch.randn(5, 16), torch.randn(5, 16)
expected = torch.sigmoid(hidden @ gate_weight)[:, None] * shared + routed
fused_gate_sigmoid_mul_add(hidden, gate_weight, shared, routed)
print((routed - expected).abs().max().item())"""


def test_shared_expert_gate_in_torch_still_needed():
    """SGLang's Qwen2-MoE adds its gated shared expert with a Triton kernel, which cannot launch without a GPU; with the
    shim the function Qwen2-MoE imports computes sigmoid(x @ gate) * shared + routed, in place."""
    without = run(GATE_PROBE.format(module="sglang.kernels.ops.elementwise.elementwise"),
                  skip="shared_expert_gate_in_torch")
    assert without.returncode != 0 and "0 active drivers" in without.stderr
    shimmed = run(GATE_PROBE.format(module="sglang.srt.models.qwen2_moe"))
    assert shimmed.returncode == 0, shimmed.stderr[-2000:]
    assert float(shimmed.stdout.split()[-1]) < 1e-6


def test_binding_engine_tp_ranks_to_cores_still_needed():
    """SGLang's CPU engine asserts one TP rank per NUMA node unless each rank's cores are named (bind_threads)."""
    probe = ("from sglang.srt.utils.numa_utils import get_cpu_ids_by_node, init_threads_binding\n"
             "print(len(get_cpu_ids_by_node()))\n"
             "print(init_threads_binding(numa_index=1, world_size=2))")
    without = run(probe)
    if without.returncode == 0 and int(without.stdout.split()[0]) >= 2:
        pytest.skip("this machine has a NUMA node per engine TP rank")
    assert without.returncode != 0 and "SGLANG_CPU_OMP_THREADS_BIND is not set" in without.stderr
    bound = run("from rlcore_rollout_sglang import cpu; cpu.bind_threads(2)\n" + probe)
    assert bound.returncode == 0, bound.stderr[-2000:]


def test_host_buffers_unpinned_still_needed():
    """SGLang allocates the routed-experts capture's host cache (enable_return_routed_experts) pinned by
    cudaHostRegister, which the CPU torch cannot do; with the shim the allocation for device "cpu" is plain."""
    probe = ("import torch\n"
             "from sglang.srt.mem_cache.pool_host.common import ALLOC_MEMORY_FUNCS, HostTensorAllocator\n"
             "buffer = ALLOC_MEMORY_FUNCS['cpu']((4, 3, 2), dtype=torch.int32, device='cpu', pin_memory=True, "
             "allocator=HostTensorAllocator())\n"
             "print(tuple(buffer.shape), buffer.is_pinned())")
    without = run(probe, skip="host_buffers_unpinned")
    assert without.returncode != 0 and "Torch not compiled with CUDA enabled" in without.stderr
    shimmed = run(probe)
    assert shimmed.returncode == 0, shimmed.stderr[-2000:]
    assert shimmed.stdout.split("\n")[-2] == "(4, 3, 2) False"

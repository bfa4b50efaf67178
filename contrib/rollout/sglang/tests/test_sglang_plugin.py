"""What does not need SGLang: the plugin registers ``sglang``, a missing SGLang is one line naming the install command,
and the ``sgl_kernel`` stand-in's implemented function does what SGLang's kernel does while the rest raise."""
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from rlcore.errors import ConfigError

plugin = pytest.importorskip("rlcore_rollout_sglang.plugin", reason="rlcore-rollout-sglang is not installed")


def test_registers_the_sglang_backend():
    assert [spec.name for spec in plugin.rlcore_rollout_backends()] == ["sglang"]


def test_missing_sglang_is_one_line_naming_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^rollout.backend=sglang needs SGLang.*pip install --no-deps .*"
                                          r"requirements-sglang.txt") as info:
        plugin._make("/nonexistent", SimpleNamespace(tp=1, kv_cache_gib=0.01))
    assert "\n" not in str(info.value)


def test_sgl_kernel_stand_in():
    from rlcore_rollout_sglang import sgl_kernel_cpu

    table = torch.full((3, 6), -1, dtype=torch.int32)
    sgl_kernel_cpu.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), table, torch.tensor([1, 0]),
                                                torch.tensor([3, 2]), torch.tensor([10, 11, 12, 13]))
    assert table[2].tolist() == [-1, 10, 11, -1, -1, -1] and table[0].tolist() == [12, 13, -1, -1, -1, -1]
    assert table[1].tolist() == [-1] * 6
    for name in sgl_kernel_cpu.NOT_IMPLEMENTED:
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} is not available"):
            getattr(sgl_kernel_cpu, name)()


def test_engine_tp_ranks_get_equal_shares_of_the_cores(monkeypatch):
    from rlcore_rollout_sglang import cpu

    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert cpu.bind_threads(2) == "0-1|2-3"
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {1, 3, 4})
    assert cpu.bind_threads(3) == "1|3|4"
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0-7|8-15")      # the user's own choice stays
    assert cpu.bind_threads(2) == "0-7|8-15"
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(cpu.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ConfigError, match="rollout.tp=2 with rollout.backend=sglang on CPU needs a core per engine "
                                          "rank; this process may use 1"):
        cpu.bind_threads(2)

"""The engine check with SGLang generating, at multi-process training layouts (Ray workers on gloo).

SGLang's offline Engine has no external launcher: its tensor-parallel ranks are processes it spawns. At rollout.tp=1
every trainer rank hosts its own engine (a replica); at rollout.tp=2 a replica's first rank hosts an engine of two
TP ranks and shares its results with the other. After every weight push the engine's logprobs on a fixed batch equal
the actor's on every rank, and the replicas that must agree do agree bit for bit."""
import importlib.util
import os

import pytest
from runs import ON_REQUEST

from test_layouts import LAYOUTS, assert_replicas_agree, run_layout

pytestmark = [pytest.mark.slow, pytest.mark.parallel]
if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (contrib/rollout/sglang/requirements-sglang.txt)", allow_module_level=True)

SGLANG = ["rollout.backend=sglang"]
# every run: TP2 training with SGLang's own TP2; PP2 with an engine per rank
EVERY_RUN = ["tp2-rollout_tp2", "pp2"]
# the rest of the vLLM layouts that run on CPU, on request (RLCORE_ALL_LAYOUTS=1): ~1.5 min each, and their
# resharded stream is the one the vLLM layouts check (SGLang's loading of MoE experts: test_qwen2_grpo's qwen2_moe)
LAYOUTS_ON_REQUEST = ["moe-ep2", "tp2", "dp2", "dp2-rollout_tp2", "moe-ep2-rollout_tp2", "pp2-uneven", "tp2-sp", "cp2",
              "qwen2-tp2-rollout_tp2", "llama-tp2-rollout_tp2", "qwen2_moe-ep2-rollout_tp2"]


@pytest.mark.parametrize("layout", EVERY_RUN + [pytest.param(layout, marks=ON_REQUEST)
                                                for layout in LAYOUTS_ON_REQUEST])
def test_sglang_engine_matches_actor_after_every_sync(tmp_path, warm_start_cache, layout):
    summary, prints, history = run_layout(tmp_path, warm_start_cache, SGLANG + LAYOUTS[layout], steps=3,
                                          engine="sglang")
    assert len(history) == 3
    # fp32 on both sides: measured 0 to 4.8e-6 (vLLM's layouts allow 1e-3)
    assert all(h["check/logprob_max_diff"] < 1e-4 for h in history), [h["check/logprob_max_diff"] for h in history]
    assert all(h["sync/bytes"] > 0 for h in history[1:])
    assert_replicas_agree(prints)

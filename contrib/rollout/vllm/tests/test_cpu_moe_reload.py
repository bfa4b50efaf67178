"""vLLM CPU MoE weight updates: after pushing weights into a live Qwen3-MoE engine, its logprobs equal transformers'
on the same weights — with rlcore's re-pack fix; without it the same pushes give wrong logprobs (the fix is still
needed). Each case runs in its own process (one in-process engine per process)."""
import json
import os
import sys
import textwrap

import pytest
from runs import run_cli

pytestmark = [pytest.mark.slow]

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoModelForCausalLM
    import rlcore_rollout_vllm.cpu_moe_reload as fix
    from rlcore.config import load_config
    from rlcore.megatron.model import read_hf_weights
    from rlcore_rollout_vllm.backend import VLLMRollout
    path, fixed = sys.argv[1], sys.argv[2] == "fixed"
    if not fixed:
        fix.repack_moe_on_reload = lambda model: 0
    sequences = [torch.randint(1, 16, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]

    def logprobs(model):
        with torch.no_grad():
            lp = torch.log_softmax(model.eval()(torch.tensor(sequences)).logits, -1)
        return [[lp[i, j - 1, s[j]].item() for j in range(1, len(s))] for i, s in enumerate(sequences)]

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    unchanged = logprobs(hf)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if ".experts." in n:
                p.mul_(1.01)
    scaled_reference = logprobs(hf)
    on_disk = dict(read_hf_weights(path))
    engine = VLLMRollout(path, load_config("quickstart", []).rollout, max_model_len=32)
    diffs = {}
    try:
        def diff(reference):
            got = engine.score(sequences, [1] * len(sequences))
            return max(abs(a - b) for g, r in zip(got, reference) for a, b in zip(g, r))
        diffs["before"] = diff(unchanged)
        engine.update_weights(iter(on_disk.items()), 1)
        diffs["unchanged"] = diff(unchanged)
        engine.update_weights(((n, t * 1.01 if ".experts." in n else t) for n, t in on_disk.items()), 2)
        diffs["scaled"] = diff(scaled_reference)
    finally:
        engine.stop()
    print("DIFFS " + json.dumps(diffs))
""")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from rlcore_model_qwen3.plugin import QWEN3_MOE
    from rlcore_plugins.tasks.arithmetic import write_char_tokenizer

    path = tmp_path_factory.mktemp("moe")
    vocab = write_char_tokenizer(str(path))
    torch.manual_seed(0)
    hf = QWEN3_MOE.tiny_hf_config(vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                  head_dim=32, ffn_hidden_size=128, max_position_embeddings=32)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return str(path)


def _diffs(tmp_path, checkpoint, mode):
    script = tmp_path / "engine.py"
    script.write_text(SCRIPT)
    result = run_cli([sys.executable, str(script), checkpoint, mode], {**os.environ, "OMP_NUM_THREADS": "1"},
                     timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("DIFFS ")]
    assert result.returncode == 0 and lines, result.stderr[-4000:]
    return json.loads(lines[-1][len("DIFFS "):])


def test_pushed_moe_weights_match_transformers(tmp_path, moe_checkpoint):
    diffs = _diffs(tmp_path, moe_checkpoint, "fixed")
    assert all(d < 1e-4 for d in diffs.values()), diffs


def test_without_the_fix_pushes_are_wrong(tmp_path, moe_checkpoint):
    diffs = _diffs(tmp_path, moe_checkpoint, "unfixed")
    assert diffs["before"] < 1e-4, diffs
    assert diffs["unchanged"] > 1e-2 and diffs["scaled"] > 1e-2, diffs

"""The check that refuses, before any worker starts, a model SGLang cannot serve: its list of architectures is the
one SGLang's own registry builds, and a refusal is one line from ``rlcore run``."""
import importlib.util
import json
import re
import subprocess
import sys

import pytest

from rlcore.errors import ConfigError

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed (contrib/rollout/sglang/requirements-sglang.txt)", allow_module_level=True)

from rlcore_rollout_sglang.architectures import entry_classes, served_architectures, unservable  # noqa: E402
from rlcore_rollout_sglang.plugin import _check  # noqa: E402

MIXTRAL = {"architectures": ["MixtralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4}


def test_the_list_read_from_source_is_sglangs_registry():
    """SGLang's registry imports every model module; those that fail to import on this CPU it leaves out, saying so
    (on GPUs it has them): the list read from the source is the registry plus exactly those modules' classes."""
    code = ("from rlcore_rollout_sglang import cpu; cpu.enable()\n"
            "from sglang.srt.models.registry import ModelRegistry\n"
            "import json; print(json.dumps(sorted(ModelRegistry.get_supported_archs())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    registry = set(json.loads(out.stdout.strip().splitlines()[-1]))
    failed = set(re.findall(r"Ignore import error when loading sglang\.srt\.models\.(\w+)", out.stderr))
    classes = entry_classes()
    assert len(registry) > 200
    assert served_architectures() == registry | {name for module in failed for name in classes[module]}


@pytest.mark.parametrize("hf, on_cpu, expected", [
    ({"architectures": ["Qwen3ForCausalLM"]}, True, None),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, True, None),
    ({**MIXTRAL, "head_dim": 16}, True, None),
    ({**MIXTRAL, "head_dim": 32}, True,
     "SGLang's Mixtral derives head_dim from hidden_size / num_attention_heads = 16"),
    ({"architectures": ["NoSuchForCausalLM"]}, False, "SGLang 0.5.23 has no model class for architecture NoSuch"),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, False, None),       # a dry run plans for GPUs
    ({"architectures": ["DeepseekV3ForCausalLM"]}, True, "disagrees with transformers by 0.22"),
    ({"architectures": ["Qwen2ForCausalLM"]}, True, None),
    ({"architectures": ["LlamaForCausalLM"]}, True, None),
    ({"architectures": ["Qwen2MoeForCausalLM"]}, True, None),     # its Triton gate is a CPU shim (cpu.py)
])
def test_unservable(hf, on_cpu, expected):
    reason = unservable(hf, on_cpu)
    assert reason is None if expected is None else expected in reason


def test_refusal_is_one_config_error_naming_the_alternative():
    with pytest.raises(ConfigError, match=r"^rollout.backend=sglang cannot serve this model: SGLang 0.5.23 has no "
                                          r"model class for architecture Nope. Use rollout.backend=vllm$"):
        _check({"architectures": ["Nope"]}, None, True)


def test_rlcore_run_refuses_before_workers_start(tmp_path):
    """A real Mixtral checkpoint whose head_dim SGLang's Mixtral would ignore."""
    from rlcore_testing.models import tiny_checkpoint
    from rlcore_model_mixtral.plugin import MIXTRAL as SPEC
    from rlcore_plugins.tasks.arithmetic import write_char_tokenizer

    tiny_checkpoint(SPEC, str(tmp_path), vocab_size=write_char_tokenizer(str(tmp_path)), hidden_size=64,
                    num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32, ffn_hidden_size=64,
                    max_position_embeddings=32)
    result = subprocess.run([sys.executable, "-m", "rlcore.cli", "run", "--plugins=mixtral,grpo,sglang",
                             "model.family=mixtral", f"model.path={tmp_path}", "rollout.backend=sglang",
                             f"run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.startswith("rlcore: error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "rollout.backend=sglang cannot serve this model: SGLang's Mixtral derives head_dim" in lines[0]
    assert "Traceback" not in result.stderr

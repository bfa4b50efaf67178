"""Coming from verl (issue 30): verl's keys translated by one table (rlcore.verl.keys). Each row gives its documented
rlcore values; unknown and unsupported keys are refused in one line; verl's example scripts (as published, in
tests/data/verl) translate key for key and pass --dry-run with the parallel layout and offload settings they ask for;
docs/coming-from-verl.md's table is the table's own rendering."""
import json
import re
from pathlib import Path

import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.plugins import load_plugins
from rlcore.sizing import dry_run
from rlcore.verl import doc
from rlcore.verl.command import run_overrides, translate_script
from rlcore.verl.keys import IGNORED, REFUSED, TABLE, TRANSLATED, lookup
from rlcore.verl.script import read_script
from rlcore.verl.translate import families_of, translate

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "tests" / "data" / "verl"
A = "actor_rollout_ref.actor"
OTC = f"{A}.megatron.override_transformer_config"


@pytest.fixture(scope="module")
def registry():
    return load_plugins(["qwen3", "deepseek", "qwen2", "llama", "grpo", "ppo", "vllm"]).registry


def _concrete(verl: str) -> str:
    return verl[:-2] + ".some_option" if verl.endswith(".*") else verl


# --- the table, row by row ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("row", [r for r in TABLE if r.status == TRANSLATED and r.example],
                         ids=lambda r: r.verl)
def test_each_translated_key_gives_its_documented_values(row, registry):
    value, expected = row.example
    t = translate([f"{row.verl}={value}", *row.needs], families_of(registry))
    line = next(line for line in t.lines if line.verl == row.verl)
    if expected:
        assert line.status == TRANSLATED
        assert {k: t.overrides.get(k) for k in expected} == expected
        assert set(line.rlcore) <= set(row.to) | set(expected), (line.rlcore, row.to)
    else:                       # documented as setting nothing with this value
        assert not line.rlcore


def test_translated_rows_without_an_example_are_read_with_a_group_that_has_one():
    groups_with_examples = {r.group for r in TABLE if r.example}
    for row in TABLE:
        if row.status == TRANSLATED and not row.example:
            assert row.group in groups_with_examples, row.verl


@pytest.mark.parametrize("row", [r for r in TABLE if r.status == IGNORED], ids=lambda r: r.verl)
def test_each_ignored_key_is_listed_with_its_reason(row):
    value = json.dumps(row.accepts[0]) if row.accepts else "7"
    t = translate([f"{_concrete(row.verl)}={value}"])
    assert (t.lines[0].status, t.lines[0].note) == (IGNORED, row.why)
    assert set(t.overrides) <= {"actor.dtype", "critic.dtype"}          # verl's bf16 default, nothing else
    if row.accepts:             # a value that would matter is refused, not ignored
        with pytest.raises(ConfigError, match="is not supported"):
            translate([f"{_concrete(row.verl)}=12345"])


@pytest.mark.parametrize("row", [r for r in TABLE if r.status == REFUSED], ids=lambda r: r.verl)
def test_each_refused_key_names_why_and_the_closest_setting(row):
    with pytest.raises(ConfigError) as e:
        translate([f"{_concrete(row.verl)}=12345"])
    message = str(e.value)
    assert "\n" not in message and row.verl.rstrip(".*") in message and row.why in message
    assert f"closest rlcore setting: {row.closest}" in message
    for fine in row.accepts:    # the values that change nothing are listed as such
        assert translate([f"{_concrete(row.verl)}={json.dumps(fine)}"]).lines[0].status == IGNORED


def test_an_unknown_verl_key_is_refused_with_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown verl key 'actor_rollout_ref\.actor\.megatron\.tensor_model_paralel"
                                          r"_size' \(did you mean 'actor_rollout_ref\.actor\.megatron\."
                                          r"tensor_model_parallel_size'\?\)"):
        translate(["actor_rollout_ref.actor.megatron.tensor_model_paralel_size=2"])


def test_refusals_name_the_value_why_and_the_closest_setting():
    cases = {f"{A.rsplit('.', 1)[0]}.model.lora.rank=8": "LoRA adapters are not trained",
             f"{A.rsplit('.', 1)[0]}.rollout.top_p=0.9": "closest rlcore setting: rollout.temperature",
             "algorithm.adv_estimator=reinforce_plus_plus": "closest rlcore setting: algorithm.name",
             "algorithm.rollout_correction.rollout_rs=token_k2": "geometric-mean ratio only"}
    for item, expected in cases.items():
        with pytest.raises(ConfigError, match="is not supported") as e:
            translate([item])
        assert expected in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="data.train_batch_size = 96 is not a multiple of it"):
        translate(["data.train_batch_size=96", f"{A}.ppo_mini_batch_size=40"])
    with pytest.raises(ConfigError, match="the actor's is 4"):
        translate([f"{A}.megatron.tensor_model_parallel_size=4",
                   "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"])


def test_keys_read_together():
    t = translate(["data.train_batch_size=512", f"{A}.ppo_mini_batch_size=128", "trainer.nnodes=4",
                   "trainer.n_gpus_per_node=8", f"{A}.use_kl_loss=True", f"{A}.kl_loss_coef=0.01",
                   f"{A}.kl_loss_type=low_var_kl", "algorithm.adv_estimator=gae", f"{A}.clip_ratio=0.3",
                   f"{A}.clip_ratio_high=0.4", "trainer.total_training_steps=100",
                   f"{A}.optim.lr_warmup_steps_ratio=0.1", "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                   "algorithm.rollout_correction.rollout_rs_threshold=0.5_3.0"])
    o = t.overrides
    assert (o["trainer.prompts_per_step"], o["actor.mini_batches"], o["trainer.world_size"]) == (512, 4, 32)
    assert (o["algorithm.kl_coef"], o["algorithm.kl_as"], o["algorithm.kl_estimator"]) == (0.01, "loss", "k3")
    assert (o["algorithm.clip_ratio_low"], o["algorithm.clip_ratio_high"]) == (0.3, 0.4)
    assert (o["trainer.steps"], o["actor.optim.lr_warmup_steps"]) == (100, 40)      # 0.1 x 100 steps x 4 updates
    assert (o["algorithm.rollout_rs_low"], o["algorithm.rollout_rs_high"]) == (0.5, 3.0)
    # hydra's prefixes: +key= is key=, ~key is listed
    t = translate([f"+{OTC}.num_layers_in_last_pipeline_stage=6", "~actor_rollout_ref.model.override_config"])
    assert t.overrides == {"actor.parallel.last_stage_layers": 6, "actor.dtype": "bfloat16"}
    assert t.lines[1].status == IGNORED and "'~'" in t.lines[1].note


def test_total_epochs_counts_the_training_rows(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(50)))
    t = translate([f"data.train_files={rows}", "data.train_batch_size=8", "trainer.total_epochs=3"])
    assert t.overrides["trainer.steps"] == 3 * (50 // 8)
    t = translate(["data.train_files=/not/here.parquet", "trainer.total_epochs=3"])
    assert t.lines[-1].status == IGNORED and "set trainer.steps" in t.lines[-1].note


def test_run_verl_mixes_rlcore_keys_which_win(registry):
    overrides, t = run_overrides(["data.train_batch_size=64", "trainer.steps=3", "trainer.prompts_per_step=32",
                                  "actor_rollout_ref.rollout.n=4", "algorithm.kl_coef=0.5"], registry)
    cfg = load_config("quickstart", overrides)
    assert [line.verl for line in t.lines] == ["data.train_batch_size", "actor_rollout_ref.rollout.n",
                                               "actor_rollout_ref.actor.megatron.dtype"]
    assert (cfg.trainer.prompts_per_step, cfg.rollout.n, cfg.trainer.steps, cfg.algorithm["kl_coef"]) == (32, 4, 3, 0.5)
    with pytest.raises(ConfigError, match="did you mean 'trainer.total_epochs'"):
        run_overrides(["trainer.total_epoch=3"], registry)


# --- verl scripts ---------------------------------------------------------------------------------------------------

SCRIPT = r"""#!/bin/bash
set -x
export BASE=/data   # where the files are
NAME=${NAME:-Qwen2.5-7B-Instruct}
TP=${TP:-2}; PP=2
files="['$BASE/a.parquet', '${BASE}/b.parquet']"
# python3 -m verl.trainer.main_ppo not=this
python3 -m verl.trainer.main_ppo --config-path=config \
    --config-name='ppo_megatron_trainer.yaml' \
    data.train_files="$files" \
    data.max_response_length=$((1024 * 3 / 2)) \
    actor_rollout_ref.model.path=$HOME/models/$NAME \
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size=${TP} \
    actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=$PP \
    trainer.experiment_name='it''s "quoted" # not a comment' \
    trainer.total_training_steps=$(( (TP + PP) * 5 )) $@  # the end
"""


def test_a_script_with_variables_defaults_comments_and_continuations_translates(registry):
    script = read_script(SCRIPT, {"HOME": "/home/u", "TP": "4"})
    assert script.config_name == "ppo_megatron_trainer"
    assert script.overrides == [
        "data.train_files=['/data/a.parquet', '/data/b.parquet']", "data.max_response_length=1536",
        "actor_rollout_ref.model.path=/home/u/models/Qwen2.5-7B-Instruct",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        'trainer.experiment_name=its "quoted" # not a comment', "trainer.total_training_steps=30"]
    o = translate(script.overrides, families_of(registry)).overrides
    assert o["task.options.train_files"] == ["/data/a.parquet", "/data/b.parquet"]
    assert (o["model.hf_config"], o["model.family"]) == ("qwen2.5-7b-instruct", "qwen2")   # bundled sizes
    assert (o["actor.parallel.tp"], o["actor.parallel.pp"], o["trainer.steps"]) == (4, 2, 30)


# The four published verl Megatron examples (tests/data/verl, each headed by its source), translated with their
# defaults: every override key accounted for, and the layout and offload settings they ask for.
PUBLISHED = {
    "run_deepseek671b_math_megatron_96gb.sh": dict(
        family="deepseek_v3", world=96, layout=dict(tp=8, pp=12, ep=8, cp=1, sp=True, last_stage_layers=6),
        offload=dict(params=True, grads=True, optimizer=True), hybrid=1.0, preset="deepseek-v3-671b-96gpu"),
    "run_qwen3-235b_megatron_96gb.sh": dict(
        family="qwen3_moe", world=32, layout=dict(tp=4, pp=8, ep=4, cp=1, sp=True, last_stage_layers=10),
        offload=dict(params=True, grads=True, optimizer=True), hybrid=1.0, preset="qwen3-235b-a22b-32gpu"),
    "run_qwen3moe-30b_megatron_96gb.sh": dict(
        family="qwen3_moe", world=8, layout=dict(tp=1, pp=1, ep=8, cp=1, sp=False, last_stage_layers=0),
        offload=dict(params=True, grads=True, optimizer=True), hybrid=1.0, preset=None),
    "run_qwen2-7b_math_megatron.sh": dict(
        family="qwen2", world=8, layout=dict(tp=2, pp=2, ep=1, cp=1, sp=True, last_stage_layers=0),
        offload=dict(params=False, grads=False, optimizer=False), hybrid=0.0, preset=None),
}
ENV = {"HOME": "/home/u", "aime24_test_path": "/data/aime-2024.parquet"}   # the 30B script reads an unset variable


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_examples_translate_and_pass_the_dry_run(name, registry, tmp_path):
    want = PUBLISHED[name]
    script = read_script((EXAMPLES / name).read_text(), ENV)
    text, t, _ = translate_script(str(EXAMPLES / name), registry, env=ENV)
    given = [item.split("=", 1)[0].lstrip("+~") for item in script.overrides]
    assert [line.verl for line in t.lines[:len(given)]] == given     # every key, in order: none dropped
    assert all(line.status in (TRANSLATED, IGNORED) and (line.status == TRANSLATED or line.note) for line in t.lines)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    cfg = load_config(str(recipe))
    assert cfg.model.family == want["family"] and cfg.trainer.world_size == want["world"]
    layout = {k: getattr(cfg.actor.parallel, k) for k in want["layout"]}
    assert layout == want["layout"]
    assert {k: getattr(cfg.actor.offload, k) for k in want["offload"]} == want["offload"]
    assert cfg.actor.optim.offload_fraction == want["hybrid"]
    assert cfg.actor.optim.name == ("hybrid_adam" if want["hybrid"] else "adam")
    problems, report = dry_run(cfg, registry.get("models", cfg.model.family))
    assert not problems, problems
    if want["preset"]:                     # the layout verl's docs state, as our preset of the same recipe has it
        preset = load_config(want["preset"])
        assert {k: getattr(preset.actor.parallel, k) for k in want["layout"]} == want["layout"]
        assert (preset.trainer.world_size, preset.actor.optim.name, preset.actor.optim.offload_fraction) == \
            (want["world"], "hybrid_adam", want["hybrid"])


def test_translate_command_writes_yaml_that_the_dry_run_accepts(tmp_path, monkeypatch, capsys):
    from rlcore.cli import main

    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "deepseek.yaml"
    assert main(["verl", "translate", str(EXAMPLES / "run_deepseek671b_math_megatron_96gb.sh"), "-o", str(out)]) == 0
    assert "tp: 8  # actor_rollout_ref.actor.megatron.tensor_model_parallel_size" in out.read_text()
    capsys.readouterr()
    assert main(["run", "--dry-run", str(out)]) == 0
    assert "world 96 = tp 8 x pp 12" in capsys.readouterr().out
    assert main(["run", "--verl", "--dry-run", "actor_rollout_ref.model.lora.rank=8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlcore: error: verl key 'actor_rollout_ref.model.lora.rank' = 8")
    assert main(["run", "--verl", "--dry-run", "deepseek-v3-671b-96gpu", "data.train_batch_size=96",
                 "actor_rollout_ref.rollout.n=4", "trainer.steps=2"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"\ndata\.train_batch_size +96 +trainer\.prompts_per_step=96\n", printed), printed
    assert "world 96 = tp 8 x pp 12" in printed


def test_the_doc_table_is_generated_from_the_table():
    path = ROOT / "docs" / "coming-from-verl.md"
    assert doc.generated_part(str(path)) == doc.render(), \
        "docs/coming-from-verl.md is stale: run `python -m rlcore.verl.doc docs/coming-from-verl.md`"
    for row in TABLE:
        assert lookup(_concrete(row.verl)) is row

"""Config loading: presets, YAML + dot-overrides, and one clear error per mistake."""
import pytest

from rlcore.config import bind_plugin_section, load_config
from rlcore.errors import ConfigError


def test_quickstart_preset_with_overrides():
    cfg = load_config("quickstart", ["trainer.steps=5", "rollout.n=4", "algorithm.kl_coef=0.01"])
    assert cfg.trainer.steps == 5 and cfg.rollout.n == 4
    assert cfg.model.family == "qwen3" and cfg.algorithm["name"] == "grpo" and cfg.algorithm["kl_coef"] == 0.01


def test_default_is_quickstart():
    assert load_config(None, []) == load_config("quickstart", [])


def test_yaml_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer: {steps: 7}\nrollout: {n: 2}\n")
    cfg = load_config(str(f), ["rollout.n=3"])
    assert cfg.trainer.steps == 7 and cfg.rollout.n == 3


def test_a_word_yaml_reads_as_a_boolean_stays_a_word_for_a_string_key():
    """``routing_replay=off`` on the command line: YAML 1.1 reads off as false, which reached the key as 'False' (and
    was refused); a boolean key still takes the same words as booleans."""
    cfg = load_config("quickstart", ["actor.moe.routing_replay=off", "run.progress=off", "trainer.export_hf=no"])
    assert cfg.actor.moe.routing_replay == "off" and cfg.run.progress is False and cfg.trainer.export_hf is False
    with pytest.raises(ConfigError, match=r"'actor.moe.routing_replay' = 'on' is not allowed: use off or rollout"):
        load_config("quickstart", ["actor.moe.routing_replay=on"])


def test_a_files_unquoted_off_for_a_string_key_is_refused_asking_for_quotes(tmp_path):
    """In a file the word cannot be recovered (YAML made it a boolean): refused in one line; quoted, it loads, and a
    boolean key still takes off."""
    f = tmp_path / "replay.yaml"
    f.write_text("actor:\n  moe:\n    routing_replay: off\nrun:\n  progress: off\n")
    with pytest.raises(ConfigError) as refused:
        load_config(str(f))
    assert str(refused.value) == (f"config file {str(f)!r}: actor.moe.routing_replay = false, which YAML made of an "
                                  f"unquoted on/off/yes/no, but the key takes a word: quote it, e.g. "
                                  f"actor.moe.routing_replay: 'off'")
    f.write_text("actor:\n  moe:\n    routing_replay: 'off'\nrun:\n  progress: off\n")
    cfg = load_config(str(f))
    assert cfg.actor.moe.routing_replay == "off" and cfg.run.progress is False


def test_misspelled_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.stpes'.*did you mean 'steps'"):
        load_config("quickstart", ["trainer.stpes=5"])


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError, match=r"'trainer.steps'.*'many'"):
        load_config("quickstart", ["trainer.steps=many"])


def test_out_of_range_value_says_what_is_allowed():
    with pytest.raises(ConfigError, match=r"'rollout.n' = 0 is not allowed: use an integer >= 1"):
        load_config("quickstart", ["rollout.n=0"])


@pytest.mark.parametrize("overrides, expected", [
    (["actor.pack_sequences=true"], "actor.pack_sequences = true needs actor.max_tokens_per_micro_batch > 0"),
    (["actor.pack_sequences=true", "actor.max_tokens_per_micro_batch=512", "trainer.world_size=2",
      "actor.parallel.cp=2"], "actor.pack_sequences = true with actor.parallel.cp = 2"),
    (["actor.old_logprobs=engine"], "'actor.old_logprobs' = 'engine' is not allowed: use auto, actor or rollout"),
    (["trainer.mode=sync"], "'trainer.mode' = 'sync' is not allowed: use colocated or async"),
    (["trainer.mode=async", "rollout.sync_every=3", "rollout.max_staleness=1"],
     "rollout.sync_every = 3 with rollout.max_staleness = 1: .* set rollout.max_staleness >= 2"),
    (["trainer.mode=async", "rollout.sync_every=2", "rollout.max_staleness=1", "actor.mini_batches=2"],
     "rollout.sync_every = 2 with rollout.max_staleness = 1: .* up to 2 versions behind; "
     "set rollout.max_staleness >= 2"),
    (["trainer.mode=async", "rollout.world_size=3", "rollout.tp=2"],
     r"rollout.world_size = 3 is not a multiple of rollout.tp = 2 \(async mode"),
])
def test_micro_batch_options_that_cannot_work_are_refused(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config("quickstart", overrides)


def test_missing_model_path(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path '.*nope' does not exist"):
        load_config("quickstart", [f"model.path={tmp_path}/nope"])
    with pytest.raises(ConfigError, match=r"has no config.json"):
        load_config("quickstart", [f"model.path={tmp_path}"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match=r"'nope.yaml' does not exist and is not a preset \(presets: .*quickstart"):
        load_config("nope.yaml", [])


def test_override_without_equals():
    with pytest.raises(ConfigError, match="key=value"):
        load_config("quickstart", ["trainer.steps"])


def test_plugin_section_is_checked_against_the_plugin_dataclass():
    from rlcore_algo_grpo.grpo import GRPOConfig

    assert bind_plugin_section("algorithm", {"name": "grpo", "kl_coef": 0.5}, GRPOConfig).kl_coef == 0.5
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm.kl_cof'.*did you mean 'kl_coef'"):
        bind_plugin_section("algorithm", {"name": "grpo", "kl_cof": 0.5}, GRPOConfig)


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.world_size=4", "actor.parallel.tp=2", "actor.parallel.ep=2", "actor.parallel.sp=true"],
     "actor.parallel.ep > 1 with actor.parallel.tp > 1 is not supported on CPU"),
])
def test_what_this_cpu_machine_cannot_run_is_refused_before_starting(overrides, expected):
    """A dry run may plan these for GPUs; a run here refuses them up front."""
    from rlcore.config import check_runnable_here

    cfg = load_config("quickstart", overrides)
    with pytest.raises(ConfigError, match=expected):
        check_runnable_here(cfg)


def test_naming_another_task_leaves_the_files_task_options_behind(tmp_path):
    (tmp_path / "recipe.yaml").write_text("task:\n  name: addition\n  options: {digits: 3}\n")
    assert load_config(str(tmp_path / "recipe.yaml"), []).task.options == {"digits": 3}
    assert load_config(str(tmp_path / "recipe.yaml"), ["task.name=addition"]).task.options == {"digits": 3}
    cfg = load_config(str(tmp_path / "recipe.yaml"), ["task.name=dataset", "task.options.train_files=[a.parquet]"])
    assert cfg.task.options == {"train_files": ["a.parquet"]}


ASYNC = ["trainer.mode=async", "rollout.world_size=1"]


@pytest.mark.parametrize("overrides, expected", [
    ([], "actor"),                                                          # colocated: on policy
    (ASYNC + ["rollout.max_staleness=0"], "actor"),
    (ASYNC + ["rollout.max_staleness=1"], "rollout"),                       # stale: PPO's ratio against the engine's
    (ASYNC + ["rollout.max_staleness=2", "algorithm.rollout_is=token"], "actor"),   # the run's own correction
    (ASYNC + ["rollout.max_staleness=2", "algorithm.rollout_is=none"], "actor"),    # ... or none, as it asked
    (ASYNC + ["rollout.max_staleness=1", "actor.old_logprobs=actor"], "actor"),
    (["actor.old_logprobs=rollout"], "rollout"),
])
def test_the_old_policy_defaults_to_the_engines_logprobs_only_for_stale_samples(overrides, expected):
    assert load_config("quickstart", overrides).actor.old_logprobs == expected


def test_async_with_the_trainers_old_policy_gets_truncated_importance_weights_unless_it_chose():
    from rlcore.rollout_correction import async_default
    grpo = pytest.importorskip("rlcore_algo_grpo.grpo")

    cfg = load_config("quickstart", ASYNC + ["rollout.max_staleness=1", "actor.old_logprobs=actor"])
    assert (async_default(cfg, grpo.GRPOConfig) == "algorithm.rollout_is=token"
            and cfg.algorithm["rollout_is"] == "token")
    for chosen in (["actor.old_logprobs=auto"], ["actor.old_logprobs=actor", "algorithm.rollout_is=none"]):
        cfg = load_config("quickstart", ASYNC + ["rollout.max_staleness=1", *chosen])
        assert async_default(cfg, grpo.GRPOConfig) is None


def test_a_list_key_given_one_value_is_a_list_of_it(tmp_path):
    """verl's form for one file, ``data.train_files=<path>``: omegaconf refused it ("AnyNode is not a ListConfig")."""
    from rlcore_plugins.tasks.dataset import DatasetOptions

    options = bind_plugin_section("task.options", {"train_files": "a.parquet", "val_files": "b.parquet"},
                                  DatasetOptions)
    assert options.train_files == ["a.parquet"] and options.val_files == ["b.parquet"]
    assert load_config("quickstart", ["trainer.loggers=console"]).trainer.loggers == ["console"]
    f = tmp_path / "c.yaml"
    f.write_text("trainer: {loggers: jsonl}\n")
    assert load_config(str(f), []).trainer.loggers == ["jsonl"]
    assert load_config(str(f), ["trainer.loggers=[console,jsonl]"]).trainer.loggers == ["console", "jsonl"]


def test_a_run_directory_expands_home_and_is_fixed_in_the_config():
    """verl's recipes name checkpoint folders under ~ (the translated ones keep them): a run writes there, not into a
    folder literally named '~'."""
    import os

    from rlcore.checkpoint import run_directory

    cfg = load_config("quickstart", ["run.dir=~/verl/ckpt/x"])
    assert run_directory(cfg) == os.path.expanduser("~/verl/ckpt/x") == cfg.run.dir
    cfg = load_config("quickstart", [])
    named = run_directory(cfg)
    assert named.startswith("runs" + os.sep) and cfg.run.dir == named == run_directory(cfg)

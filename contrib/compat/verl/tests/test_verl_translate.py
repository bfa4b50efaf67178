"""Coming from verl (issue 30): verl's keys translated by one table (rlcore_verl.keys). Each row gives its documented
rlcore values; unknown and unsupported keys are refused in one line; verl's example scripts (as published, in
tests/data/verl) translate key for key and pass --dry-run with the parallel layout and offload settings they ask for;
docs/coming-from-verl.md's table is the table's own rendering."""
import json
import os
import re
from pathlib import Path

import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.plugins import load_plugins
from rlcore.dry_run import dry_run
from rlcore_verl import doc
from rlcore_verl.command import run_overrides, translate_script
from rlcore_verl.keys import IGNORED, REFUSED, TABLE, TRANSLATED, lookup
from rlcore_verl.script import read_script
from rlcore_verl.translate import families_of, translate

from runs import run_cli

ROOT = Path(__file__).resolve().parents[4]                     # the checkout: configs/, docs/, scripts/
EXAMPLES = Path(__file__).resolve().parent / "data" / "verl"
ARR = "actor_rollout_ref"
A = f"{ARR}.actor"
OTC = f"{A}.megatron.override_transformer_config"


@pytest.fixture(scope="module")
def registry():
    return load_plugins(["qwen3", "deepseek", "qwen2", "llama", "grpo", "ppo", "vllm"]).registry


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A byte-level BPE tokenizer trained here, with Qwen3's special tokens and a Qwen3-style chat template."""
    from rlcore_testing.gsm8k import chat_tokenizer

    return chat_tokenizer()


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


# ``needs``: what makes the row apply (the reward model's rows: reward_model.enable=True with a model.path)

@pytest.mark.parametrize("row", [r for r in TABLE if r.status == IGNORED], ids=lambda r: r.verl)
def test_each_ignored_key_is_listed_with_its_reason(row):
    value = json.dumps(row.accepts[0]) if row.accepts else "7"
    t = translate([f"{_concrete(row.verl)}={value}", *row.needs])
    assert (t.lines[0].status, t.lines[0].note) == (IGNORED, row.why)
    assert set(t.overrides) <= {"actor.dtype", "critic.dtype"} | set(translate(list(row.needs)).overrides)
    if row.accepts:             # a value that would matter is refused, not ignored
        with pytest.raises(ConfigError, match="is not supported"):
            translate([f"{_concrete(row.verl)}=12345", *row.needs])


@pytest.mark.parametrize("row", [r for r in TABLE if r.status == REFUSED], ids=lambda r: r.verl)
def test_each_refused_key_names_why_and_the_closest_setting(row):
    with pytest.raises(ConfigError) as e:
        translate([f"{_concrete(row.verl)}=12345", *row.needs])
    message = str(e.value)
    assert "\n" not in message and row.verl.rstrip(".*") in message and row.why in message
    assert f"closest rlcore setting: {row.closest}" in message
    for fine in row.accepts:    # the values that change nothing are listed as such
        assert translate([f"{_concrete(row.verl)}={json.dumps(fine)}", *row.needs]).lines[0].status == IGNORED


# Every key the Megatron examples of verl b178a3c set (examples/grpo_trainer/*megatron*.sh and
# examples/ppo_trainer/*megatron*.sh, 22 scripts; '+' prefixes dropped): each has a row, its own or a wildcard's.
VERL_MEGATRON_EXAMPLE_KEYS = """
    actor_rollout_ref.actor.clip_ratio_c actor_rollout_ref.actor.clip_ratio_high
    actor_rollout_ref.actor.clip_ratio_low actor_rollout_ref.actor.entropy_coeff
    actor_rollout_ref.actor.kl_loss_coef actor_rollout_ref.actor.kl_loss_type
    actor_rollout_ref.actor.loss_agg_mode actor_rollout_ref.actor.megatron.context_parallel_size
    actor_rollout_ref.actor.megatron.dist_checkpointing_path
    actor_rollout_ref.actor.megatron.expert_model_parallel_size
    actor_rollout_ref.actor.megatron.expert_tensor_parallel_size actor_rollout_ref.actor.megatron.grad_offload
    actor_rollout_ref.actor.megatron.optimizer_offload
    actor_rollout_ref.actor.megatron.override_transformer_config.account_for_embedding_in_pipeline_split
    actor_rollout_ref.actor.megatron.override_transformer_config.account_for_loss_in_pipeline_split
    actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend
    actor_rollout_ref.actor.megatron.override_transformer_config.bias_activation_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.bias_dropout_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.deallocate_pipeline_outputs
    actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.masked_softmax_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_enable_deepep
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_permute_fusion
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_shared_expert_overlap
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type
    actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff
    actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage
    actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage
    actor_rollout_ref.actor.megatron.override_transformer_config.persist_layer_norm
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method
    actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers
    actor_rollout_ref.actor.megatron.param_offload actor_rollout_ref.actor.megatron.pipeline_model_parallel_size
    actor_rollout_ref.actor.megatron.tensor_model_parallel_size
    actor_rollout_ref.actor.megatron.use_dist_checkpointing actor_rollout_ref.actor.megatron.use_mbridge
    actor_rollout_ref.actor.megatron.vanilla_mbridge
    actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size
    actor_rollout_ref.actor.optim.clip_grad actor_rollout_ref.actor.optim.lr
    actor_rollout_ref.actor.optim.lr_decay_style actor_rollout_ref.actor.optim.lr_warmup_steps
    actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload
    actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction
    actor_rollout_ref.actor.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d
    actor_rollout_ref.actor.optim.override_optimizer_config.use_precision_aware_optimizer
    actor_rollout_ref.actor.optim.weight_decay actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu actor_rollout_ref.actor.ppo_mini_batch_size
    actor_rollout_ref.actor.profiler.all_ranks actor_rollout_ref.actor.profiler.enable
    actor_rollout_ref.actor.profiler.ranks actor_rollout_ref.actor.use_dynamic_bsz
    actor_rollout_ref.actor.use_kl_loss actor_rollout_ref.actor.use_torch_compile
    actor_rollout_ref.model.lora.alpha actor_rollout_ref.model.lora.lora_A_init_method
    actor_rollout_ref.model.lora.rank
    actor_rollout_ref.model.override_config.model_config.max_position_embeddings actor_rollout_ref.model.path
    actor_rollout_ref.model.trust_remote_code actor_rollout_ref.model.use_fused_kernels
    actor_rollout_ref.nccl_timeout actor_rollout_ref.ref.log_prob_max_token_len_per_gpu
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu actor_rollout_ref.ref.log_prob_use_dynamic_bsz
    actor_rollout_ref.ref.megatron.context_parallel_size actor_rollout_ref.ref.megatron.dist_checkpointing_path
    actor_rollout_ref.ref.megatron.expert_model_parallel_size
    actor_rollout_ref.ref.megatron.expert_tensor_parallel_size actor_rollout_ref.ref.megatron.param_offload
    actor_rollout_ref.ref.megatron.pipeline_model_parallel_size
    actor_rollout_ref.ref.megatron.tensor_model_parallel_size
    actor_rollout_ref.ref.megatron.use_dist_checkpointing
    actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size
    actor_rollout_ref.rollout.calculate_log_probs
    actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes
    actor_rollout_ref.rollout.enable_chunked_prefill actor_rollout_ref.rollout.enforce_eager
    actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_max_tokens_ratio
    actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters
    actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache
    actor_rollout_ref.rollout.free_cache_engine actor_rollout_ref.rollout.gpu_memory_utilization
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz actor_rollout_ref.rollout.max_num_batched_tokens
    actor_rollout_ref.rollout.max_num_seqs actor_rollout_ref.rollout.mode actor_rollout_ref.rollout.n
    actor_rollout_ref.rollout.name actor_rollout_ref.rollout.temperature
    actor_rollout_ref.rollout.tensor_model_parallel_size actor_rollout_ref.rollout.top_k
    actor_rollout_ref.rollout.top_p actor_rollout_ref.rollout.val_kwargs.do_sample
    actor_rollout_ref.rollout.val_kwargs.n actor_rollout_ref.rollout.val_kwargs.temperature
    actor_rollout_ref.rollout.val_kwargs.top_k actor_rollout_ref.rollout.val_kwargs.top_p
    algorithm.adv_estimator algorithm.kl_ctrl.kl_coef algorithm.use_kl_in_reward
    critic.megatron.context_parallel_size critic.megatron.dist_checkpointing_path
    critic.megatron.expert_model_parallel_size critic.megatron.expert_tensor_parallel_size
    critic.megatron.grad_offload critic.megatron.optimizer_offload critic.megatron.param_offload
    critic.megatron.pipeline_model_parallel_size critic.megatron.tensor_model_parallel_size
    critic.megatron.use_dist_checkpointing critic.model.path critic.model.trust_remote_code critic.optim.lr
    critic.ppo_micro_batch_size_per_gpu critic.profiler.all_ranks critic.profiler.enable critic.profiler.ranks
    data.filter_overlong_prompts data.max_prompt_length data.max_response_length data.prompt_key
    data.return_raw_chat data.shuffle data.train_batch_size data.train_files data.truncation
    data.trust_remote_code data.val_files global_profiler.global_tool_config.nsys.discrete global_profiler.steps
    global_profiler.tool reward_model.reward_kwargs.max_resp_len
    reward_model.reward_kwargs.overlong_buffer_cfg.enable reward_model.reward_kwargs.overlong_buffer_cfg.len
    reward_model.reward_kwargs.overlong_buffer_cfg.log
    reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor reward_model.reward_manager
    trainer.critic_warmup trainer.default_local_dir trainer.experiment_name trainer.log_val_generations
    trainer.logger trainer.n_gpus_per_node trainer.nnodes trainer.project_name trainer.resume_mode
    trainer.save_freq trainer.test_freq trainer.total_epochs trainer.total_training_steps
    trainer.val_before_train
""".split()


def test_every_key_of_verls_megatron_examples_has_a_row():
    assert len(VERL_MEGATRON_EXAMPLE_KEYS) == 161
    assert [k for k in VERL_MEGATRON_EXAMPLE_KEYS if lookup(k) is None] == []


def test_an_unknown_verl_key_is_refused_with_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown verl key 'actor_rollout_ref\.actor\.megatron\.tensor_model_paralel"
                                          r"_size' \(did you mean 'actor_rollout_ref\.actor\.megatron\."
                                          r"tensor_model_parallel_size'\?\)"):
        translate(["actor_rollout_ref.actor.megatron.tensor_model_paralel_size=2"])


def test_refusals_name_the_value_why_and_the_closest_setting():
    cases = {"critic.model.lora.rank=8": "rlcore adapts the actor only (only 0 has a counterpart); closest rlcore "
                                         "setting: actor.lora.rank",
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


def test_verls_lora_keys_in_both_forms_set_the_actors_adapters():
    megatron = translate([f"{ARR}.model.lora.rank=16", f"{ARR}.model.lora.alpha=32",
                          f"{ARR}.model.lora.target_modules=[linear_qkv,linear_fc1]"])
    fsdp = translate([f"{ARR}.model.lora_rank=16", f"{ARR}.model.lora_alpha=32",
                      f"{ARR}.model.target_modules=[q_proj,k_proj,v_proj,up_proj,gate_proj]"])
    for t in (megatron, fsdp):
        lora = load_config("quickstart", t.dotlist()).actor.lora
        assert (lora.rank, lora.alpha, lora.target_modules) == (16, 32.0, ["linear_qkv", "linear_fc1"])
    every = translate([f"{ARR}.model.lora_rank=8", f"{ARR}.model.target_modules=all-linear"]).overrides
    assert every["actor.lora.target_modules"] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


# --- reward models ----------------------------------------------------------------------------------------------

RM = "reward_model"
RM_ON = [f"{RM}.enable=True", f"{RM}.model.path=/ckpt/rm"]


def test_reward_model_keys_have_no_effect_unless_the_reward_model_is_enabled():
    keys = [f"{RM}.model.path=/ckpt/rm", f"{RM}.micro_batch_size_per_gpu=4",
            f"{RM}.megatron.tensor_model_parallel_size=2", f"{RM}.strategy=fsdp", f"{RM}.model.external_lib=pkg",
            f"{RM}.enable_resource_pool=True", f"{RM}.load_weight=False"]
    for given in (keys, [f"{RM}.enable=False", *keys]):        # verl's default, and said
        t = translate(given)
        assert all(line.status == IGNORED for line in t.lines), t.table()
        assert not any(k.startswith(f"{RM}.") for k in t.overrides)
        assert "used only with reward_model.enable=True" in t.lines[-1].note


def test_an_enabled_reward_model_translates_its_checkpoint_batching_and_layout():
    t = translate([*RM_ON, f"{RM}.micro_batch_size_per_gpu=16", f"{RM}.megatron.tensor_model_parallel_size=2",
                   f"{RM}.megatron.pipeline_model_parallel_size=2", f"{RM}.megatron.context_parallel_size=2",
                   f"{RM}.megatron.expert_model_parallel_size=2", f"{RM}.megatron.sequence_parallel=False",
                   f"{RM}.megatron.param_offload=True", f"{RM}.model.input_tokenizer=/ckpt/policy",
                   f"{RM}.model.trust_remote_code=True", f"{RM}.reward_manager=naive", f"{RM}.strategy=megatron"])
    rm = {k: v for k, v in t.overrides.items() if k.startswith(f"{RM}.")}
    assert rm == {f"{RM}.path": "/ckpt/rm", f"{RM}.dtype": "bfloat16", f"{RM}.micro_batch_size": 16,
                  f"{RM}.parallel.tp": 2, f"{RM}.parallel.pp": 2, f"{RM}.parallel.cp": 2, f"{RM}.parallel.ep": 2,
                  f"{RM}.parallel.sp": False, f"{RM}.offload.params": True}
    status = {line.verl: line.status for line in t.lines}
    assert status[f"{RM}.model.input_tokenizer"] == IGNORED and status[f"{RM}.strategy"] == IGNORED
    assert "re-tokenizes" in next(line.note for line in t.lines if line.verl == f"{RM}.model.input_tokenizer")
    assert "weight 0" in t.lines[0].note            # the enable line says what the reward is
    # the dtype given wins over verl's bfloat16 default
    assert translate([*RM_ON, f"{RM}.megatron.dtype=float32"]).overrides[f"{RM}.dtype"] == "float32"


def test_the_reward_models_tp_is_the_one_verl_uses_and_its_pool_its_world_size():
    both = [*RM_ON, f"{RM}.megatron.tensor_model_parallel_size=2", f"{RM}.rollout.tensor_model_parallel_size=4"]
    t = translate(both)                                  # the reward loop (verl's default): the engine's TP
    assert (t.overrides[f"{RM}.parallel.tp"], t.overrides[f"{RM}.parallel.sp"]) == (4, True)
    assert t.lines[2].status == IGNORED and "use_reward_loop=True" in t.lines[2].note
    t = translate([*both, f"{RM}.use_reward_loop=False"])  # the legacy Megatron workers: theirs
    assert t.overrides[f"{RM}.parallel.tp"] == 2 and t.lines[3].status == IGNORED
    t = translate([*RM_ON, f"{RM}.rollout.tensor_model_parallel_size=2", f"{RM}.rollout.name=vllm",
                   f"{RM}.rollout.gpu_memory_utilization=0.8", f"{RM}.num_workers=8"])
    assert t.overrides[f"{RM}.parallel.tp"] == 2 and [line.status for line in t.lines[3:]] == [IGNORED] * 3
    pool = translate([*RM_ON, f"{RM}.enable_resource_pool=True", f"{RM}.n_gpus_per_node=4", f"{RM}.nnodes=2"])
    assert pool.overrides[f"{RM}.world_size"] == 8
    shared = translate([*RM_ON, f"{RM}.n_gpus_per_node=4", f"{RM}.nnodes=2"])
    assert f"{RM}.world_size" not in shared.overrides and shared.lines[-1].status == IGNORED


def test_the_reward_models_token_budget_follows_verls_defaults():
    own = translate([*RM_ON, f"{RM}.use_dynamic_bsz=True", f"{RM}.forward_max_token_len_per_gpu=4096"]).overrides
    assert (own[f"{RM}.max_tokens_per_micro_batch"], own[f"{RM}.pack_sequences"]) == (4096, True)
    # verl's reward_model.use_dynamic_bsz is the critic's, the critic's the actor's; the budget the critic's
    inherited = translate([*RM_ON, f"{A}.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=8192"]).overrides
    assert (inherited[f"{RM}.max_tokens_per_micro_batch"], inherited[f"{RM}.pack_sequences"]) == (8192, True)
    off = translate([*RM_ON, f"{A}.use_dynamic_bsz=True", f"{RM}.use_dynamic_bsz=False"]).overrides
    assert off[f"{RM}.max_tokens_per_micro_batch"] == 0


@pytest.mark.parametrize("given, names, says", [
    ([f"{RM}.enable=True"], f"{RM}.enable", "add reward_model.model.path="),
    ([*RM_ON, f"{RM}.strategy=fsdp"], f"{RM}.strategy", "rlcore runs the reward model on Megatron"),
    ([*RM_ON, "custom_reward_function.path=/r.py"], f"{RM}.enable", "set reward_model.use_reward_loop=False"),
    ([*RM_ON, f"{RM}.enable_resource_pool=True"], f"{RM}.enable_resource_pool", "give both"),
    ([*RM_ON, f"{RM}.model.external_lib=my_models"], f"{RM}.model.external_lib", "installed model family"),
    ([*RM_ON, f"{RM}.micro_batch_size=64"], f"{RM}.micro_batch_size",
     "closest rlcore setting: reward_model.micro_batch_size"),
    ([*RM_ON, f"{RM}.megatron.virtual_pipeline_model_parallel_size=2"], "virtual_pipeline", "interleaved"),
    ([*RM_ON, f"{RM}.load_weight=False"], f"{RM}.load_weight", "random weights"),
    ([f"{RM}.reward_loop_source=importlib"], f"{RM}.reward_loop_source", "custom reward-loop classes"),
])
def test_what_rlcore_cannot_do_with_a_reward_model_is_refused_in_one_line(given, names, says):
    with pytest.raises(ConfigError) as e:
        translate(given)
    message = str(e.value)
    assert "\n" not in message and names in message and says in message, message


def test_an_enabled_reward_model_with_a_rule_based_reward_scores_as_verl_does(tmp_path):
    """verl returns the reward model's score in place of the rule-based reward (legacy workers), or under its reward
    loop scores with a custom function alone (refused above): rlcore trains on the reward model's score and logs the
    function's beside it at weight 0."""
    from rlcore.rewards import build_rewards
    from rlcore.specs import RewardSpec

    reward = tmp_path / "r.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 10.0\n")
    t = translate([*RM_ON, f"{RM}.use_reward_loop=False", f"custom_reward_function.path={reward}",
                   f"{RM}.reward_manager=dapo", f"{RM}.reward_kwargs.overlong_buffer_cfg.enable=True",
                   f"{RM}.reward_kwargs.overlong_buffer_cfg.len=64", f"{RM}.reward_kwargs.max_resp_len=256"])
    assert t.overrides["task.reward_fn"] == f"{reward}:compute_score" and "task.rewards" not in t.overrides
    assert not any(k.startswith("algorithm.overlong") for k in t.overrides)   # verl's dapo manager skips it too
    cfg = load_config("quickstart", [f"{k}={json.dumps(v)}" for k, v in t.overrides.items()
                                     if not k.startswith(f"{RM}.")])
    registry = load_plugins(["qwen3", "grpo"]).registry
    registry.add("rewards", RewardSpec("rm", lambda r, m, s: [0.5] * len(r), sequences=True), owner="test")
    composer = build_rewards(cfg.task, "", {}, registry, model_reward=cfg.reward_model.name)
    assert [(spec.name, weight) for spec, weight in composer.rewards] == [("rm", 1.0), ("compute_score", 0.0)]
    scores = composer(["x"], [{"data_source": "d", "answer": "1"}], [[1, 2]])
    assert scores.total.tolist() == [0.5] and scores.components["compute_score"].tolist() == [10.0]


def test_run_verl_tells_verls_reward_model_keys_from_rlcores(registry):
    overrides, t = run_overrides([*RM_ON, f"{RM}.megatron.tensor_model_parallel_size=2", f"{RM}.name=score",
                                  f"{RM}.world_size=4", f"{RM}.parallel.pp=2"], registry)
    assert [line.verl for line in t.lines][:3] == [*(item.split("=")[0] for item in RM_ON),
                                                   f"{RM}.megatron.tensor_model_parallel_size"]
    assert overrides[-3:] == [f"{RM}.name=score", f"{RM}.world_size=4", f"{RM}.parallel.pp=2"]   # rlcore's own
    with pytest.raises(ConfigError, match="did you mean 'reward_model.model.path'"):
        run_overrides([f"{RM}.enable=True", f"{RM}.model.pth=/ckpt/rm"], registry)


def _reward_model_checkpoint(path: Path) -> Path:
    """A tiny Qwen2 sequence classifier, as transformers writes one (config.json and model.safetensors)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, num_labels=1,
                         pad_token_id=0, architectures=["Qwen2ForSequenceClassification"])
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    return path


def test_a_verl_command_line_with_a_reward_model_translates_to_a_config_rlcore_loads(tmp_path, registry, capsys):
    from rlcore.cli import main
    from rlcore.megatron.reward_model import check_reward_model

    rm = _reward_model_checkpoint(tmp_path / "rm")
    verl = ["algorithm.adv_estimator=gae", "data.train_files=/data/hh/train.parquet",
            "data.val_files=/data/hh/test.parquet", "data.train_batch_size=256", "data.max_prompt_length=512",
            "data.max_response_length=512", "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct",
            f"{A}.ppo_mini_batch_size=64", f"{A}.ppo_micro_batch_size_per_gpu=4",
            f"{A}.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "critic.optim.lr=1e-5",
            "critic.ppo_micro_batch_size_per_gpu=4", "critic.megatron.tensor_model_parallel_size=2",
            f"{RM}.enable=True", f"{RM}.model.path={rm}", f"{RM}.model.input_tokenizer=null",
            f"{RM}.micro_batch_size_per_gpu=8", f"{RM}.megatron.tensor_model_parallel_size=2",
            f"{RM}.megatron.pipeline_model_parallel_size=2", f"{RM}.megatron.param_offload=True",
            f"{RM}.use_reward_loop=False", f"{RM}.reward_manager=naive", "algorithm.use_kl_in_reward=False",
            "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.total_training_steps=10"]
    overrides, t = run_overrides(verl, registry)
    assert all(line.status in (TRANSLATED, IGNORED) for line in t.lines)
    cfg = load_config("quickstart", overrides)
    section = cfg.reward_model
    assert (section.path, section.name, section.micro_batch_size, section.dtype) == (str(rm), "rm", 8, "bfloat16")
    assert (section.parallel.tp, section.parallel.pp, section.parallel.sp, section.offload.params) == (2, 2, True, True)
    assert section.world_size == 0 and cfg.trainer.world_size == 8 and not cfg.task.rewards
    hf_config = json.loads((rm / "config.json").read_text())
    assert check_reward_model(registry.models, hf_config, str(rm), section.dtype).name == "qwen2"
    # the same as a script, through `rlcore verl translate`
    script = tmp_path / "run_qwen2-7b_rm.sh"
    script.write_text("python3 -m verl.trainer.main_ppo \\\n" + "".join(f"    {item} \\\n" for item in verl)
                      + "    $@\n")
    out = tmp_path / "rm.yaml"
    assert main(["verl", "translate", str(script), "-o", str(out)]) == 0
    capsys.readouterr()
    assert f"path: {json.dumps(str(rm))}  # reward_model.enable, reward_model.model.path" in out.read_text()
    recipe = load_config(str(out))
    assert (recipe.reward_model.path, recipe.reward_model.parallel.pp) == (str(rm), 2)


def test_total_epochs_counts_the_training_rows(tmp_path):
    rows = tmp_path / "train.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(50)))
    t = translate([f"data.train_files={rows}", "data.train_batch_size=8", "trainer.total_epochs=3"])
    assert t.overrides["trainer.steps"] == 3 * (50 // 8)
    t = translate(["data.train_files=/not/here.parquet", "trainer.total_epochs=3"])
    assert t.lines[-1].status == IGNORED and "set trainer.steps" in t.lines[-1].note


def test_run_verl_mixes_rlcore_keys_which_win(registry):
    overrides, t = run_overrides(["data.train_batch_size=64", "trainer.steps=3", "trainer.prompts_per_step=32",
                                  "actor_rollout_ref.rollout.n=4", "algorithm.kl_coef=0.5", "agent.max_turns=2"],
                                 registry)
    cfg = load_config("quickstart", overrides)
    assert cfg.agent == {"max_turns": 2}        # the agent's section, bound by its plugin's dataclass
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


# verl's docs/perf/dpsk.md (b178a3c): the environment variables its tables recommend per GPU count for the three MoE
# scripts (num gpus: NNODES, TP, PP, EP, OFFLOAD_FRACTION, OFFLOAD_OPTIM, LAST_LAYER). The Qwen3-235B script reads
# OPTIM_OFFLOAD (the table says OFFLOAD_OPTIM) and places its layers by account_for_*_in_pipeline_split, not
# LAST_LAYER; the Qwen3-30B script reads COMMON_TP/PP/EP.
DOCUMENTED = [
    *[("run_deepseek671b_math_megatron_96gb.sh", f"deepseek-v3-671b-{g}gpu",
       dict(NNODES=n, TP=tp, PP=pp, EP=ep, OFFLOAD_FRACTION=f, OFFLOAD_OPTIM=o, LAST_LAYER=last))
      for g, n, tp, pp, ep, f, o, last in [(96, 12, 8, 12, 8, "1.", "False", 6), (128, 16, 8, 16, 8, "0.5", "True", 1),
                                           (256, 32, 8, 16, 8, "0.", "True", 1), (512, 64, 1, 16, 32, "0", "True", 1)]],
    *[("run_qwen3-235b_megatron_96gb.sh", f"qwen3-235b-a22b-{g}gpu",
       dict(NNODES=n, TP=4, PP=8, EP=4, OFFLOAD_FRACTION=f, OPTIM_OFFLOAD=o, LAST_LAYER=6))
      for g, n, f, o in [(32, 4, "1.", "False"), (64, 8, "0.5", "True"), (128, 16, "0", "True"),
                         (256, 32, "0", "True")]],
    *[("run_qwen3moe-30b_megatron_96gb.sh", f"qwen3-30b-a3b-{g}gpu",
       dict(NNODES=n, COMMON_TP=1, COMMON_PP=1, COMMON_EP=8, OFFLOAD_FRACTION="1."))
      for g, n in [(8, 1), (16, 2), (32, 4)]],
]


@pytest.mark.parametrize("script, preset, env", DOCUMENTED, ids=[d[1] for d in DOCUMENTED])
def test_verls_documented_layouts_translate_to_our_presets_layouts(script, preset, env, registry, tmp_path):
    text, _, _ = translate_script(str(EXAMPLES / script), registry, env={**ENV, **{k: str(v) for k, v in env.items()}})
    (tmp_path / "verl.yaml").write_text(text)
    ours, theirs = load_config(str(tmp_path / "verl.yaml")), load_config(preset)

    def layout(cfg):
        p, o = cfg.actor.parallel, cfg.actor.offload
        return (cfg.trainer.world_size, p.tp, p.pp, p.ep, p.cp, p.sp, p.last_stage_layers, cfg.actor.optim.name,
                cfg.actor.optim.offload_fraction, o.params, o.grads, o.optimizer, cfg.actor.dtype)

    assert layout(ours) == layout(theirs)
    assert not dry_run(ours, registry.get("models", ours.model.family))[0]


def test_the_verl_recipes_in_configs_are_the_translations_and_pass_the_dry_run(registry):
    import importlib.util

    spec = importlib.util.spec_from_file_location("verl_recipes", ROOT / "scripts" / "verl_recipes.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    recipes = module.recipes()
    assert sorted(p.name for p in recipes) == sorted(p.name for p in (ROOT / "configs").glob("verl-*.yaml"))
    for path, text in recipes.items():
        assert path.read_text() == text, f"{path.name} is stale: run python scripts/verl_recipes.py"
        cfg = load_config(path.stem)                          # by name, as a preset
        problems, _ = dry_run(cfg, registry.get("models", cfg.model.family))
        assert not problems, (path.name, problems)


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
    assert main(["run", "--verl", "--dry-run", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rlcore: error: verl key "
                                                    "'actor_rollout_ref.actor.policy_loss.loss_mode' = gspo")
    assert main(["run", "--verl", "--dry-run", "deepseek-v3-671b-96gpu", "data.train_batch_size=96",
                 "actor_rollout_ref.rollout.n=4", "trainer.steps=2"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"\ndata\.train_batch_size +96 +trainer\.prompts_per_step=96\n", printed), printed
    assert "world 96 = tp 8 x pp 12" in printed


def test_the_doc_table_is_generated_from_the_table():
    path = ROOT / "docs" / "coming-from-verl.md"
    assert doc.generated_part(str(path)) == doc.render(), \
        "docs/coming-from-verl.md is stale: run `python -m rlcore_verl.doc docs/coming-from-verl.md`"
    for row in TABLE:
        assert lookup(_concrete(row.verl)) is row


# --- end to end -----------------------------------------------------------------------------------------------------

def _gsm8k_job(tmp_path, chat_tokenizer):
    """The tiny GSM8K job of tests/e2e/test_gsm8k_e2e.py: a tiny Qwen3 checkpoint, GSM8K-format Parquet, and a
    verl-style compute_score that prefers short answers (a random model solves nothing; this gives the update a
    gradient)."""
    from rlcore.cli import main
    from rlcore_testing.models import tiny_checkpoint
    from rlcore_testing.gsm8k import gsm8k_lines
    from rlcore_model_qwen3.plugin import QWEN3

    ckpt = tmp_path / "ckpt"
    tiny_checkpoint(QWEN3, str(ckpt), vocab_size=len(chat_tokenizer), hidden_size=64, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=32, ffn_hidden_size=128, max_position_embeddings=512,
                    eos_token_id=chat_tokenizer.eos_token_id)
    chat_tokenizer.save_pretrained(ckpt)
    for split, count, offset in (("train", 24, 0), ("test", 6, 100)):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in gsm8k_lines(count, offset)))
        assert main(["dataset", "gsm8k", str(tmp_path / f"{split}.jsonl"), str(tmp_path / f"{split}.parquet"),
                     f"--split={split}"]) == 0
    (tmp_path / "brevity.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):"
                                         "\n    return -len(solution_str) / 200\n")
    return ckpt


def _metrics(run_dir: Path) -> list[dict]:
    """Each step's metrics, less the ones that measure time."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not re.search(r"time|_s$|/s\b|per_s|throughput|seconds", k)}
            for row in rows]


@pytest.mark.slow
@pytest.mark.e2e
def test_a_verl_gsm8k_command_line_runs_as_the_same_run_in_rlcore_keys(tmp_path, chat_tokenizer):
    import sys

    ckpt = _gsm8k_job(tmp_path, chat_tokenizer)
    train, test, reward = tmp_path / "train.parquet", tmp_path / "test.parquet", tmp_path / "brevity.py"
    verl = [  # as verl's examples/grpo_trainer scripts write them, at the fixture's size
        "algorithm.adv_estimator=grpo", f"data.train_files={train}", f"data.val_files=['{test}']",
        "data.train_batch_size=4", "data.max_prompt_length=512", "data.max_response_length=48",
        "data.filter_overlong_prompts=True", "data.truncation='error'", f"actor_rollout_ref.model.path={ckpt}",
        "actor_rollout_ref.actor.megatron.dtype=float32", "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "algorithm.use_kl_in_reward=False", f"custom_reward_function.path={reward}", "trainer.critic_warmup=0",
        "trainer.logger=['console']", "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.test_freq=-1",
        "trainer.total_training_steps=3"]
    rlcore_keys = [
        "algorithm.name=grpo", "task.name=dataset", f"task.options.train_files=[{train}]",
        f"task.options.val_files=[{test}]", "trainer.prompts_per_step=4", "task.options.max_prompt_len=512",
        "rollout.max_response_len=48", f"model.path={ckpt}", "actor.dtype=float32", "actor.optim.lr=1e-4",
        "actor.mini_batches=2", "actor.micro_batch_size=8", "algorithm.kl_coef=0.01", "algorithm.kl_estimator=k3",
        "actor.entropy_coef=0", "rollout.backend=vllm", "rollout.n=4", "rollout.tp=1",
        f"task.reward_fn={reward}:compute_score", "critic.warmup_steps=0", "trainer.loggers=[console,jsonl]",
        "trainer.devices_per_node=1", "trainer.world_size=1", "trainer.eval_every=0", "trainer.steps=3"]
    runs = {}
    for name, flags, args in (("verl", ["--verl"], verl), ("rlcore", [], rlcore_keys)):
        run_dir = tmp_path / name
        result = run_cli([sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", *flags,
                          "quickstart", *args, "run.progress=false", f"run.dir={run_dir}"],
                         timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = _metrics(run_dir)
    assert [row["step"] for row in runs["verl"]] == [1, 2, 3]
    assert runs["verl"] == runs["rlcore"]
    assert all(row["actor/grad_norm"] > 0 and row["reward/compute_score/mean"] < 0 and row["actor/kl_ref"] > 0
               for row in runs["verl"])                  # the file's compute_score scored it; the KL loss is on
    saved = (tmp_path / "verl" / "verl_translation.txt").read_text()
    assert saved.startswith(f"verl keys: {len(verl)} ") and "task.reward_fn=" in saved
    assert len(json.loads((tmp_path / "verl" / "verl_translation.json").read_text())) == len(verl)

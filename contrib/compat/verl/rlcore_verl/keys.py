"""The translation table: every verl key rlcore knows, as data. A key is translated (to rlcore keys, through a value
conversion), ignored (no effect in rlcore, with the reason) or refused (with the reason and the closest rlcore
setting). Keys whose meaning needs other keys (a ratio, a switch and its value) name a ``group``: the translator
reads every key first and then translates each group at once (``rlcore_verl.groups``).

Each translated row carries an example, a verl value with the rlcore values it gives, which is what
docs/coming-from-verl.md shows and what tests/test_verl_translate.py checks, row by row."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

TRANSLATED, IGNORED, REFUSED = "translated", "ignored", "refused"


class Refused(ValueError):
    """A verl value rlcore cannot honour: ``why``, and the closest rlcore setting."""

    def __init__(self, why: str, closest: str = ""):
        super().__init__(why)
        self.why, self.closest = why, closest


@dataclass(frozen=True)
class Key:
    verl: str                                   # the verl key; ending in ".*": every key below it
    status: str                                 # translated | ignored | refused
    to: tuple[str, ...] = ()                    # the rlcore keys it sets
    convert: Callable[[Any], tuple] | None = None   # verl value -> the values of ``to`` (raises Refused)
    why: str = ""                               # what it means in rlcore / why it has no effect / why refused
    closest: str = ""                           # refused: the rlcore setting nearest to it
    group: str = ""                             # translated with the other keys of its group, after all are read
    example: tuple[str, dict[str, Any]] | None = None   # (verl value, {rlcore key: value}) with ``needs`` given
    needs: tuple[str, ...] = ()                 # other verl overrides the example needs (key=value)
    accepts: tuple[Any, ...] = field(default=())  # ignored/refused rows: values that are fine (no effect); others
                                                # are refused with ``why`` (empty = every value)


# --- value conversions: each checks its type and names what it wanted -------------------------------------------

def as_int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise Refused(f"{v!r} is not an integer")
    return int(v)


def as_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Refused(f"{v!r} is not a number")
    return float(v)


def as_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise Refused(f"{v!r} is not True or False")
    return v


def as_str(v: Any) -> str:
    if v is None or isinstance(v, (list, dict)):
        raise Refused(f"{v!r} is not a string")
    return str(v)


def as_paths(v: Any) -> list[str]:
    """verl takes one path or a list of paths."""
    items = v if isinstance(v, list) else [v]
    if not items or not all(isinstance(p, str) and p for p in items):
        raise Refused(f"{v!r} is not a path or a list of paths")
    return list(items)


HF_TO_MEGATRON_LINEARS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
                          "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
                          "down_proj": "linear_fc2"}
ALL_LINEARS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def lora_targets(v: Any) -> list[str]:
    """verl's LoRA target modules -> megatron-core's linear names: its Megatron form as is, its FSDP form (HF's
    projection names, or all-linear) mapped; the order kept, each once."""
    items = v if isinstance(v, list) else [v]
    if not items or not all(isinstance(x, str) for x in items):
        raise Refused(f"{v!r} is not a module name or a list of them")
    names = ALL_LINEARS if items == ["all-linear"] else [HF_TO_MEGATRON_LINEARS.get(str(x), str(x)) for x in items]
    return list(dict.fromkeys(names))


def one(fn: Callable[[Any], Any]) -> Callable[[Any], tuple]:
    return lambda v: (fn(v),)


def choice(mapping: dict[Any, Any], closest: str) -> Callable[[Any], tuple]:
    """verl's names -> rlcore's; any other value refused, naming the ones that work."""
    def convert(v: Any) -> tuple:
        if v not in mapping:
            raise Refused(f"{v!r} has no rlcore counterpart (rlcore takes {', '.join(map(str, mapping))})", closest)
        return (mapping[v],)
    return convert


def steps_or_off(v: Any) -> tuple:
    """verl's frequencies: -1 (or 0) = never -> rlcore's 0."""
    n = as_int(v)
    return (max(n, 0),)


# --- rows -------------------------------------------------------------------------------------------------------

def mapped(verl: str, to: str | tuple[str, ...], convert: Callable[[Any], tuple], why: str,
           example: tuple[str, dict[str, Any]], needs: tuple[str, ...] = ()) -> Key:
    return Key(verl, TRANSLATED, (to,) if isinstance(to, str) else to, convert, why, example=example, needs=needs)


def grouped(verl: str, group: str, to: tuple[str, ...], why: str, example: tuple[str, dict[str, Any]] | None,
            needs: tuple[str, ...] = ()) -> Key:
    return Key(verl, TRANSLATED, to, None, why, group=group, example=example, needs=needs)


def ignored(verl: str, why: str, accepts: tuple[Any, ...] = (), closest: str = "") -> Key:
    return Key(verl, IGNORED, why=why, accepts=accepts, closest=closest)


def refused(verl: str, why: str, closest: str, accepts: tuple[Any, ...] = ()) -> Key:
    return Key(verl, REFUSED, why=why, closest=closest, accepts=accepts)


ARR = "actor_rollout_ref"
A, R, REF = f"{ARR}.actor", f"{ARR}.rollout", f"{ARR}.ref"
LOGGING = "logging only (rlcore writes metrics.jsonl and the console)"
ENGINE_TUNING = "an engine tuning knob; rlcore runs vLLM/SGLang with its own settings"
KERNEL_TUNING = "a Megatron kernel, fusion or dispatch switch; rlcore runs megatron-core's defaults"
SAME_LAYOUT = "the reference policy runs in the actor's layout in rlcore (refused when it differs from the actor's)"
PROFILER = "verl's profiler; rlcore profiles with its own switches (trainer.profile_steps)"


def megatron_rows(verl: str, section: str) -> list[Key]:
    """``<verl>.megatron.*`` (actor or critic) -> ``<section>.parallel/offload``: Megatron's parallel sizes and
    offload switches mean the same in both."""
    m = f"{verl}.megatron"
    return [
        grouped(f"{m}.tensor_model_parallel_size", f"{section}_tp",
                (f"{section}.parallel.tp", f"{section}.parallel.sp"),
                "tensor parallel size; verl turns on sequence parallelism (its default) whenever TP > 1",
                ("8", {f"{section}.parallel.tp": 8, f"{section}.parallel.sp": True})),
        grouped(f"{m}.sequence_parallel", f"{section}_tp", (f"{section}.parallel.sp",),
                "sequence parallelism in TP regions (only with TP > 1, as in verl)",
                ("False", {f"{section}.parallel.tp": 2, f"{section}.parallel.sp": False}),
                needs=(f"{m}.tensor_model_parallel_size=2",)),
        mapped(f"{m}.pipeline_model_parallel_size", f"{section}.parallel.pp", one(as_int), "pipeline parallel size",
               ("12", {f"{section}.parallel.pp": 12})),
        mapped(f"{m}.expert_model_parallel_size", f"{section}.parallel.ep", one(as_int), "expert parallel size",
               ("8", {f"{section}.parallel.ep": 8})),
        mapped(f"{m}.context_parallel_size", f"{section}.parallel.cp", one(as_int), "context parallel size",
               ("2", {f"{section}.parallel.cp": 2})),
        refused(f"{m}.expert_tensor_parallel_size", "rlcore never splits experts over TP ranks (expert TP is 1)",
                f"{section}.parallel.ep", accepts=(1,)),
        refused(f"{m}.virtual_pipeline_model_parallel_size", "the interleaved (virtual) pipeline schedule is not "
                "supported", f"{section}.parallel.pp", accepts=(None, 1)),
        mapped(f"{m}.param_offload", f"{section}.offload.params", one(as_bool),
               "parameters on the host while idle", ("True", {f"{section}.offload.params": True})),
        mapped(f"{m}.grad_offload", f"{section}.offload.grads", one(as_bool),
               "gradients on the host while idle", ("True", {f"{section}.offload.grads": True})),
        mapped(f"{m}.optimizer_offload", f"{section}.offload.optimizer", one(as_bool),
               "optimizer state on the host while idle", ("True", {f"{section}.offload.optimizer": True})),
        mapped(f"{m}.dtype", f"{section}.dtype", choice({"bfloat16": "bfloat16", "bf16": "bfloat16",
                                                         "float32": "float32", "fp32": "float32"},
                                                        f"{section}.dtype"),
               "the trained weights' dtype", ("bfloat16", {f"{section}.dtype": "bfloat16"})),
        refused(f"{m}.use_distributed_optimizer", "rlcore always shards the optimizer over data-parallel ranks",
                f"{section}.optim.name", accepts=(True,)),
        refused(f"{m}.use_dist_checkpointing", "rlcore starts from HF safetensors or its own converted format",
                "`rlcore convert` then model.path", accepts=(False,)),
        ignored(f"{m}.dist_checkpointing_path", "used only with use_dist_checkpointing=True (refused)"),
        ignored(f"{m}.use_mbridge", "rlcore maps HF weights through its model plugins (no mbridge)"),
        ignored(f"{m}.vanilla_mbridge", "rlcore maps HF weights through its model plugins (no mbridge)"),
        ignored(f"{m}.seed", "Megatron's init seed; rlcore seeds everything from run.seed", closest="run.seed"),
        grouped(f"{m}.override_transformer_config.recompute_granularity", f"{section}_recompute",
                (f"{section}.recompute",), "activation recomputation: full (with megatron's uniform method, 1 "
                "layer: each layer's input kept) or selective (core attention)",
                ("full", {f"{section}.recompute": "full"}),
                needs=(f"+{m}.override_transformer_config.recompute_method=uniform",
                       f"+{m}.override_transformer_config.recompute_num_layers=1")),
        grouped(f"{m}.override_transformer_config.recompute_method", f"{section}_recompute", (),
                "with recompute_granularity=full: uniform (the only method rlcore runs)", None),
        grouped(f"{m}.override_transformer_config.recompute_num_layers", f"{section}_recompute", (),
                "with recompute_granularity=full: 1 (the only count rlcore runs)", None),
        ignored(f"{m}.override_transformer_config.recompute_modules", "selective recompute covers core attention in "
                "rlcore", accepts=(["core_attn"],)),
        grouped(f"{m}.override_transformer_config.num_layers_in_last_pipeline_stage", f"{section}_stages",
                (f"{section}.parallel.last_stage_layers",), "decoder layers on the last pipeline stage, the others "
                "even", ("6", {f"{section}.parallel.last_stage_layers": 6})),
        grouped(f"{m}.override_transformer_config.account_for_embedding_in_pipeline_split", f"{section}_stages",
                (f"{section}.parallel.last_stage_layers",), "True: verl counts the embedding as a layer of the first "
                "stage; rlcore keeps the stages before the last equal, so the last stage gets the layers left "
                "(needs the model's layer count: model.path or a bundled config)", None),
        grouped(f"{m}.override_transformer_config.account_for_loss_in_pipeline_split", f"{section}_stages",
                (f"{section}.parallel.last_stage_layers",), "True: verl counts the loss as a layer of the last "
                "stage; see account_for_embedding_in_pipeline_split", None),
        refused(f"{m}.override_transformer_config.num_layers_in_first_pipeline_stage", "rlcore sets the last stage's "
                "layer count only", f"{section}.parallel.last_stage_layers"),
        refused(f"{m}.override_transformer_config.moe_aux_loss_coeff", "rlcore trains MoE routers without an "
                "auxiliary load-balancing loss", "(none)", accepts=(0, 0.0)),
        refused(f"{m}.override_transformer_config.moe_z_loss_coeff", "rlcore trains MoE routers without a z-loss",
                "(none)", accepts=(0, 0.0, None)),
        ignored(f"{m}.override_transformer_config.*", KERNEL_TUNING),
        ignored(f"{m}.override_ddp_config.*", "Megatron DDP bucket tuning; rlcore uses its own DDP settings"),
        ignored(f"{m}.override_mcore_model_config.*", "rlcore builds the model config from the HF config.json"),
        ignored(f"{m}.use_remove_padding", "rlcore packs sequences by actor.pack_sequences (see use_dynamic_bsz)"),
        ignored(f"{m}.forward_only", "set by verl itself for reference/reward models"),
    ]


def optim_rows(verl: str, section: str) -> list[Key]:
    """``<verl>.optim.*`` -> ``<section>.optim.*`` (Megatron's optimizer config in both)."""
    o, to = f"{verl}.optim", f"{section}.optim"
    occ = f"{o}.override_optimizer_config"
    return [
        mapped(f"{o}.lr", f"{to}.lr", one(as_float), "peak learning rate", ("1e-6", {f"{to}.lr": 1e-6})),
        mapped(f"{o}.weight_decay", f"{to}.weight_decay", one(as_float), "AdamW weight decay",
               ("0.1", {f"{to}.weight_decay": 0.1})),
        mapped(f"{o}.clip_grad", f"{to}.clip_grad", one(as_float), "gradient-norm clip",
               ("1.0", {f"{to}.clip_grad": 1.0})),
        grouped(f"{o}.lr_warmup_steps", f"{section}_warmup", (f"{to}.lr_warmup_steps",),
                "steps of linear warm-up (-1: use lr_warmup_steps_ratio); verl steps its LR once a step, rlcore once "
                "an update, so it counts N x mini_batches x epochs updates",
                ("10", {f"{to}.lr_warmup_steps": 40}), needs=("data.train_batch_size=1024",
                                                           f"{verl}.ppo_mini_batch_size=256")),
        grouped(f"{o}.lr_warmup_steps_ratio", f"{section}_warmup", (f"{to}.lr_warmup_steps",),
                "warm-up as a share of the run's steps, then counted in updates as lr_warmup_steps is (needs "
                "trainer.total_training_steps, or total_epochs with the training files on this machine)",
                ("0.1", {f"{to}.lr_warmup_steps": 5}), needs=("trainer.total_training_steps=50",)),
        mapped(f"{o}.lr_decay_style", f"{to}.lr_schedule",
               choice({"constant": "constant", "cosine": "cosine", "linear": "linear"}, f"{to}.lr_schedule"),
               "LR after warm-up", ("cosine", {f"{to}.lr_schedule": "cosine"})),
        mapped(f"{o}.min_lr", f"{to}.min_lr", one(as_float), "where cosine/linear decay ends",
               ("1e-7", {f"{to}.min_lr": 1e-7})),
        mapped(f"{o}.betas", (f"{to}.adam_beta1", f"{to}.adam_beta2"), _betas, "Adam's betas",
               ("[0.9,0.95]", {f"{to}.adam_beta1": 0.9, f"{to}.adam_beta2": 0.95})),
        refused(f"{o}.optimizer", "rlcore's Megatron optimizers are Adam(W) (adam, hybrid_adam)", f"{to}.name",
                accepts=("adam",)),
        refused(f"{o}.lr_warmup_init", "rlcore's warm-up rises linearly from 0 (its first update at lr / N)",
                f"{to}.lr_warmup_steps", accepts=(0, 0.0)),
        ignored(f"{o}.total_training_steps", "set by verl itself from the trainer's steps"),
        ignored(f"{o}.lr_decay_steps", "rlcore decays over the whole run", accepts=(None,),
                closest=f"{to}.lr_schedule"),
        ignored(f"{o}.use_checkpoint_opt_param_scheduler", "rlcore checkpoints its LR schedule with the run",
                accepts=(False,)),
        grouped(f"{occ}.optimizer_offload_fraction", f"{section}_hybrid", (f"{to}.name", f"{to}.offload_fraction"),
                "with optimizer_cpu_offload=True: Megatron's hybrid CPU/GPU optimizer, this share of the "
                "optimizer state held and stepped on the host",
                ("1.0", {f"{to}.name": "hybrid_adam", f"{to}.offload_fraction": 1.0}),
                needs=(f"+{occ}.optimizer_cpu_offload=True",)),
        grouped(f"{occ}.optimizer_cpu_offload", f"{section}_hybrid", (f"{to}.name", f"{to}.offload_fraction"),
                "True: the hybrid CPU/GPU optimizer (hybrid_adam) with optimizer_offload_fraction (Megatron's "
                "default 0: nothing offloaded, so no effect alone)",
                ("True", {f"{to}.name": "hybrid_adam", f"{to}.offload_fraction": 0.5}),
                needs=(f"+{occ}.optimizer_offload_fraction=0.5",)),
        ignored(f"{occ}.overlap_cpu_optimizer_d2h_h2d", "a transfer-overlap switch of the hybrid optimizer; "
                "rlcore's hybrid_adam copies between steps"),
        ignored(f"{occ}.use_precision_aware_optimizer", "with fp32 state (Megatron's default dtypes) the optimizer "
                "steps as rlcore's: fp32 master weights and moments"),
        ignored(f"{occ}.*", "a Megatron optimizer tuning knob"),
    ]


def _betas(v: Any) -> tuple:
    if not (isinstance(v, list) and len(v) == 2):
        raise Refused(f"{v!r} is not a list of two numbers")
    return (as_float(v[0]), as_float(v[1]))


RM = "reward_model"
RM_NEEDS = (f"{RM}.enable=True", f"{RM}.model.path=/ckpt/rm")
RM_OFF = "used only with reward_model.enable=True (verl's default is False: no reward model)"
RM_LAYOUT = "rlcore runs the reward model on Megatron workers of its own (reward_model.parallel)"


def rm_row(verl: str, to: tuple[str, ...], convert: Callable[[Any], tuple] | None, why: str,
           example: tuple[str, dict[str, Any]] | None, needs: tuple[str, ...] = RM_NEEDS, closest: str = "") -> Key:
    """A reward-model key with effect only when ``reward_model.enable=True``, as in verl: read with the group
    ``reward_model`` (``rlcore_verl.groups.reward_model``), which applies ``convert`` or reads it with the others."""
    return Key(verl, TRANSLATED, to, convert, why, closest, group="reward_model", example=example, needs=needs)


def rm_only(row: Key) -> Key:
    """An ignored or refused row that applies only with the reward model enabled (otherwise listed as unused)."""
    return replace(row, group="reward_model", needs=RM_NEEDS)


def reward_model_rows() -> list[Key]:
    """verl's ``reward_model.*`` -> rlcore's ``reward_model`` section: a sequence classifier scoring each episode.

    What verl does with an enabled reward model and a rule-based reward (b178a3c): its legacy reward-model workers
    (``use_reward_loop=False``) write ``rm_scores``, which the naive/dapo/batch/prime reward managers return as the
    reward without calling ``compute_score``; its reward loop (``use_reward_loop=True``, the default) scores with the
    reward model alone unless ``custom_reward_function.path`` is given, and then with that function alone, handing it
    the reward model's server address. verl never adds the two. So the reward model's score is the reward, which is
    rlcore's default with ``reward_model.path`` (the rule-based reward logged beside it at weight 0); a custom
    function under the reward loop is refused (rlcore gives no function the reward model)."""
    m = f"{RM}.megatron"
    return [
        rm_row(f"{RM}.enable", (f"{RM}.path", f"{RM}.dtype", f"{RM}.max_tokens_per_micro_batch",
                                f"{RM}.pack_sequences"), None,
               "True (with model.path): the reward model's score is the reward, as verl's reward managers return it "
               "in place of the rule-based reward; rlcore logs that reward (custom_reward_function's or the data "
               "source's) beside it at weight 0. In bfloat16 unless megatron.dtype is given, and by the critic's "
               "use_dynamic_bsz unless its own is (verl's defaults). False: nothing",
               ("True", {f"{RM}.path": "/ckpt/rm", f"{RM}.dtype": "bfloat16"}), needs=(f"{RM}.model.path=/ckpt/rm",),
               closest=f"{RM}.path"),
        rm_row(f"{RM}.model.path", (f"{RM}.path",), None,
               "the reward model: a Hugging Face sequence-classification checkpoint of a family rlcore has",
               ("/ckpt/rm", {f"{RM}.path": "/ckpt/rm"}), needs=(f"{RM}.enable=True",)),
        ignored(f"{RM}.model.input_tokenizer", "rlcore re-tokenizes each sequence with the reward model's own "
                "tokenizer when it differs from the policy's (the policy's rendered text, decoded and encoded again; "
                "no second chat template)"),
        ignored(f"{RM}.model.trust_remote_code", "rlcore reads config.json itself and runs no remote code"),
        rm_only(refused(f"{RM}.model.external_lib", "rlcore imports no model code for the reward model: it must be a "
                        "sequence classifier of an installed model family", f"{RM}.path", accepts=(None,))),
        rm_only(refused(f"{RM}.model.override_config.*", "rlcore takes the reward model's sizes from its config.json",
                        f"{RM}.path")),
        ignored(f"{RM}.model.use_remove_padding", "FSDP-only; sequences are packed with use_dynamic_bsz",
                closest=f"{RM}.pack_sequences"),
        ignored(f"{RM}.model.use_fused_kernels", KERNEL_TUNING),
        ignored(f"{RM}.model.use_shm", "rlcore reads checkpoints from their directory"),
        ignored(f"{RM}.model.fsdp_config.*", "FSDP-only: " + RM_LAYOUT, closest=f"{RM}.offload.params"),
        ignored(f"{RM}.ulysses_sequence_parallel_size", "FSDP-only; Megatron's context parallel is cp",
                closest=f"{RM}.parallel.cp"),
        rm_only(ignored(f"{RM}.strategy", RM_LAYOUT + ": drop strategy and give its layout as "
                        "reward_model.megatron.*", accepts=("megatron",), closest=f"{RM}.parallel.tp")),
        rm_row(f"{RM}.micro_batch_size_per_gpu", (f"{RM}.micro_batch_size",), one(as_int), "sequences per forward "
               "pass", ("8", {f"{RM}.micro_batch_size": 8})),
        rm_only(refused(f"{RM}.micro_batch_size", "a global micro-batch size (deprecated in verl)",
                        f"{RM}.micro_batch_size", accepts=(None,))),
        rm_row(f"{RM}.use_dynamic_bsz", (f"{RM}.max_tokens_per_micro_batch", f"{RM}.pack_sequences"), None,
               "micro-batches by a token budget (forward_max_token_len_per_gpu), sequences packed as the actor's",
               ("True", {f"{RM}.max_tokens_per_micro_batch": 16384, f"{RM}.pack_sequences": True}),
               needs=(*RM_NEEDS, f"{RM}.forward_max_token_len_per_gpu=16384")),
        rm_row(f"{RM}.forward_max_token_len_per_gpu", (f"{RM}.max_tokens_per_micro_batch", f"{RM}.pack_sequences"),
               None,
               "the token budget of a micro-batch, with use_dynamic_bsz=True (verl's default: the critic's)",
               ("8192", {f"{RM}.max_tokens_per_micro_batch": 8192}), needs=(*RM_NEEDS, f"{RM}.use_dynamic_bsz=True")),
        ignored(f"{RM}.max_length", "rlcore scores whole sequences up to the reward model's context (its "
                "max_position_embeddings); a longer one is counted as failed, not truncated"),
        # layout: the legacy Megatron workers' (megatron.*) or the reward loop's scoring engine's TP
        rm_row(f"{m}.tensor_model_parallel_size", (f"{RM}.parallel.tp", f"{RM}.parallel.sp"), None,
               "tensor parallel size (sequence parallelism on when > 1, as verl's default); given with "
               "rollout.tensor_model_parallel_size, use_reward_loop picks one as verl does (True: the rollout's)",
               ("4", {f"{RM}.parallel.tp": 4, f"{RM}.parallel.sp": True})),
        rm_row(f"{m}.sequence_parallel", (f"{RM}.parallel.sp",), None,
               "sequence parallelism in TP regions (only with TP > 1, as in verl)",
               ("False", {f"{RM}.parallel.tp": 2, f"{RM}.parallel.sp": False}),
               needs=(*RM_NEEDS, f"{m}.tensor_model_parallel_size=2")),
        rm_row(f"{m}.pipeline_model_parallel_size", (f"{RM}.parallel.pp",), one(as_int), "pipeline parallel size",
               ("2", {f"{RM}.parallel.pp": 2})),
        rm_row(f"{m}.context_parallel_size", (f"{RM}.parallel.cp",), one(as_int), "context parallel size",
               ("2", {f"{RM}.parallel.cp": 2})),
        rm_row(f"{m}.expert_model_parallel_size", (f"{RM}.parallel.ep",), one(as_int), "expert parallel size",
               ("2", {f"{RM}.parallel.ep": 2})),
        rm_only(refused(f"{m}.expert_tensor_parallel_size", "rlcore never splits experts over TP ranks (expert TP "
                        "is 1)", f"{RM}.parallel.ep", accepts=(None, 1))),
        rm_only(refused(f"{m}.virtual_pipeline_model_parallel_size", "the interleaved (virtual) pipeline schedule "
                        "is not supported", f"{RM}.parallel.pp", accepts=(None, 1))),
        rm_row(f"{m}.param_offload", (f"{RM}.offload.params",), one(as_bool),
               "the reward model's weights on the host between its passes",
               ("True", {f"{RM}.offload.params": True})),
        rm_row(f"{m}.dtype", (f"{RM}.dtype",), choice({"bfloat16": "bfloat16", "bf16": "bfloat16",
                                                      "float32": "float32", "fp32": "float32"}, f"{RM}.dtype"),
               "the reward model's dtype (verl's default bfloat16)", ("float32", {f"{RM}.dtype": "float32"})),
        rm_only(refused(f"{m}.use_dist_checkpointing", "rlcore reads the reward model from HF safetensors",
                        f"{RM}.path", accepts=(False,))),
        ignored(f"{m}.*", "a Megatron setting of verl's reward-model workers; rlcore builds the reward model with "
                "megatron-core's defaults (scoring only: no optimizer)"),
        rm_only(refused(f"{RM}.load_weight", "rlcore scores with the checkpoint's weights (False: random weights)",
                        f"{RM}.path", accepts=(True,))),
        # where it runs: verl's own pool of n_gpus_per_node x nnodes devices, or the trainer's
        rm_row(f"{RM}.enable_resource_pool", (f"{RM}.world_size",), None,
               "True: the reward model on a pool of its own, n_gpus_per_node x nnodes devices = its worker "
               "processes; False: as many as the workers it scores for (rlcore's world_size 0)",
               ("True", {f"{RM}.world_size": 16}),
               needs=(*RM_NEEDS, f"{RM}.n_gpus_per_node=8", f"{RM}.nnodes=2")),
        rm_row(f"{RM}.n_gpus_per_node", (f"{RM}.world_size",), None, "with enable_resource_pool=True",
               ("4", {f"{RM}.world_size": 4}), needs=(*RM_NEEDS, f"{RM}.enable_resource_pool=True", f"{RM}.nnodes=1")),
        rm_row(f"{RM}.nnodes", (f"{RM}.world_size",), None, "with enable_resource_pool=True",
               ("2", {f"{RM}.world_size": 16}),
               needs=(*RM_NEEDS, f"{RM}.enable_resource_pool=True", f"{RM}.n_gpus_per_node=8")),
        # verl's reward loop: the reward model served by vLLM/SGLang; rlcore scores on Megatron either way
        ignored(f"{RM}.use_reward_loop", "verl's reward loop (True, its default) or its legacy reward-model workers; "
                "rlcore scores on the reward model's Megatron workers either way. It picks the TP key "
                "(rollout.tensor_model_parallel_size or megatron.*) and, with custom_reward_function.path, whether "
                "that function replaces the reward model's score (True; refused: rlcore gives no function the reward "
                "model)"),
        rm_row(f"{RM}.rollout.tensor_model_parallel_size", (f"{RM}.parallel.tp", f"{RM}.parallel.sp"), None,
               "the reward loop's scoring engine's TP: rlcore's reward model split as many ways (see "
               "megatron.tensor_model_parallel_size)", ("2", {f"{RM}.parallel.tp": 2, f"{RM}.parallel.sp": True})),
        ignored(f"{RM}.rollout.*", "a setting of the reward loop's scoring engine (vLLM/SGLang); " + RM_LAYOUT),
        ignored(f"{RM}.num_workers", "verl's reward-loop processes that send episodes to the scoring engine; rlcore "
                "scores episodes in its rollout loop"),
        ignored(f"{RM}.launch_reward_fn_async", "rlcore scores episodes as they finish, beside generation"),
        refused(f"{RM}.reward_loop_source", "custom reward-loop classes are not loaded; rlcore's rewards are "
                "functions", "task.reward_fn", accepts=("register",)),
        ignored(f"{RM}.reward_loop_module_path", "used only with reward_loop_source=importlib (refused)"),
        ignored(f"{RM}.reward_loop_class_name", "used only with reward_loop_source=importlib (refused)"),
        ignored(f"{RM}.sandbox_fusion.*", "verl's code-execution service for its built-in code scores; rlcore "
                "scores with registered rewards or task.reward_fn", closest="task.reward_fn"),
        ignored(f"{RM}.reward_kwargs.*", "arguments of verl's reward manager; rlcore's dapo counterpart reads "
                "overlong_buffer_cfg and max_resp_len"),
        ignored(f"{RM}.nccl_timeout", "rlcore's collectives use torch's default timeout"),
        ignored(f"{RM}.profiler.*", PROFILER),
    ]


TABLE: list[Key] = [
    # --- data ---------------------------------------------------------------------------------------------------
    grouped("data.train_files", "data", ("task.name", "task.options.train_files"),
            "the dataset task reads verl's Parquet as is; one path or a list",
            ("/d/train.parquet", {"task.name": "dataset", "task.options.train_files": ["/d/train.parquet"]})),
    grouped("data.val_files", "data", ("task.name", "task.options.val_files"), "held-out prompts",
            ("['/d/a.parquet','/d/b.parquet']", {"task.name": "dataset",
                                                 "task.options.val_files": ["/d/a.parquet", "/d/b.parquet"]})),
    mapped("data.prompt_key", "task.options.prompt_key", one(as_str), "the prompt column",
           ("question", {"task.options.prompt_key": "question"})),
    mapped("data.max_prompt_length", "task.options.max_prompt_len", one(as_int),
           "longer rendered prompts are left out and counted", ("1024", {"task.options.max_prompt_len": 1024})),
    mapped("data.max_response_length", "rollout.max_response_len", one(as_int), "response tokens per sample",
           ("1024", {"rollout.max_response_len": 1024})),
    grouped("data.train_batch_size", "batch", ("trainer.prompts_per_step",), "prompts per step",
            ("1024", {"trainer.prompts_per_step": 1024})),
    mapped("data.shuffle", "task.options.shuffle", one(as_bool), "a seeded shuffle per epoch",
           ("False", {"task.options.shuffle": False})),
    mapped("data.seed", "run.seed", one(as_int), "seeds prompt order (and the rest of the run)",
           ("7", {"run.seed": 7})),
    ignored("data.truncation", "rlcore never truncates a prompt: longer ones are left out and counted "
            "(verl's filter_overlong_prompts)", closest="task.options.max_prompt_len"),
    ignored("data.filter_overlong_prompts", "always on in rlcore (prompts over max_prompt_len are left out, counted)"),
    ignored("data.filter_overlong_prompts_workers", "rlcore renders prompts in its own process"),
    ignored("data.return_raw_chat", "rlcore renders chat prompts with the checkpoint's template itself"),
    ignored("data.return_raw_input_ids", "rlcore renders chat prompts with the checkpoint's template itself"),
    ignored("data.return_full_prompt", LOGGING),
    ignored("data.trust_remote_code", "rlcore reads tokenizers without remote code"),
    ignored("data.dataloader_num_workers", "rlcore reads prompt files once, in its own process"),
    ignored("data.val_batch_size", "evaluation batches are the engine's concern in rlcore"),
    ignored("data.reward_fn_key", "rewards dispatch on data_source", accepts=("data_source",)),
    ignored("data.use_shm", "rlcore reads files directly"),
    refused("data.train_max_samples", "rlcore trains on every row of the files", "task.options.train_files",
            accepts=(-1, None)),
    refused("data.val_max_samples", "rlcore evaluates every row of the files", "task.options.val_files",
            accepts=(-1, None)),
    refused("data.custom_cls.*", "custom dataset classes are not loaded; rlcore's tasks are plugins",
            "task.name", accepts=(None, "")),
    refused("data.apply_chat_template_kwargs.*", "chat-template arguments apply to the tools agent only",
            "agent.template_kwargs"),
    # --- model --------------------------------------------------------------------------------------------------
    grouped(f"{ARR}.model.path", "model", ("model.path", "model.family"),
            "the HF checkpoint; its architecture picks model.family. A path not on this machine whose name is a "
            "bundled config (e.g. Qwen3-235B-A22B) gives model.hf_config instead, for --dry-run",
            ("Qwen/Qwen3-30B-A3B-Base", {"model.hf_config": "qwen3-30b-a3b", "model.family": "qwen3_moe"})),
    ignored(f"{ARR}.model.use_fused_kernels", KERNEL_TUNING),
    ignored(f"{ARR}.model.trust_remote_code", "rlcore reads config.json itself and runs no remote code"),
    ignored(f"{ARR}.model.override_config.model_config.max_position_embeddings", "rlcore takes the context length "
            "from the checkpoint's config.json (RoPE does not depend on it)"),
    refused(f"{ARR}.model.override_config.*", "rlcore takes the model's sizes from its config.json", "model.path"),
    # LoRA: verl's Megatron keys (model.lora.*, megatron-core's linear names) and its FSDP ones (model.lora_rank, HF's
    # projection names) both set actor.lora; model.lora.merge picks what the engine gets (rollout.lora)
    mapped(f"{ARR}.model.lora.rank", "actor.lora.rank", one(as_int), "adapter rank (0: off, full fine-tuning)",
           ("16", {"actor.lora.rank": 16})),
    mapped(f"{ARR}.model.lora.alpha", "actor.lora.alpha", one(as_float), "the adapters' scale is alpha / rank",
           ("32", {"actor.lora.alpha": 32.0})),
    mapped(f"{ARR}.model.lora.dropout", "actor.lora.dropout", one(as_float), "dropout on the adapters' input",
           ("0.05", {"actor.lora.dropout": 0.05})),
    mapped(f"{ARR}.model.lora.target_modules", "actor.lora.target_modules", one(lora_targets),
           "the adapted linears, megatron-core's names",
           ("[linear_qkv,linear_proj]", {"actor.lora.target_modules": ["linear_qkv", "linear_proj"]})),
    refused(f"{ARR}.model.lora.exclude_modules", "rlcore adapts exactly the target_modules",
            "actor.lora.target_modules", accepts=([], None)),
    refused(f"{ARR}.model.lora.type", "rlcore's adapters are plain LoRA", "actor.lora.rank", accepts=("lora",)),
    refused(f"{ARR}.model.lora.dropout_position", "rlcore's dropout is on the adapters' input", "actor.lora.dropout",
            accepts=("pre",)),
    mapped(f"{ARR}.model.lora.merge", "rollout.lora", one(lambda v: "merged" if as_bool(v) else "adapters"),
           "True: the engine gets each adapted weight merged (W + B A x scale); False: the adapters alone, which it "
           "serves on the base weights (vLLM)", ("False", {"rollout.lora": "adapters"})),
    ignored(f"{ARR}.model.lora.lora_A_init_method", "rlcore initialises A as PEFT does; B starts at 0, so the "
            "starting model is the base model either way"),
    refused(f"{ARR}.model.lora.lora_B_init_method", "B starts at 0 in rlcore (the starting model is the base model)",
            "actor.lora.rank", accepts=("zero",)),
    ignored(f"{ARR}.model.lora.a2a_experimental", ENGINE_TUNING, accepts=(False,)),
    mapped(f"{ARR}.model.lora_rank", "actor.lora.rank", one(as_int), "verl's FSDP name of lora.rank",
           ("8", {"actor.lora.rank": 8})),
    mapped(f"{ARR}.model.lora_alpha", "actor.lora.alpha", one(as_float), "verl's FSDP name of lora.alpha",
           ("16", {"actor.lora.alpha": 16.0})),
    mapped(f"{ARR}.model.target_modules", "actor.lora.target_modules", one(lora_targets),
           "HF's projection names (verl's FSDP form): all-linear is every one; q/k/v_proj are the fused linear_qkv "
           "(adapting one adapts all three), o_proj linear_proj, gate/up_proj linear_fc1, down_proj linear_fc2",
           ("[q_proj,v_proj,o_proj]", {"actor.lora.target_modules": ["linear_qkv", "linear_proj"]})),
    refused(f"{ARR}.model.exclude_modules", "rlcore adapts exactly the target_modules", "actor.lora.target_modules",
            accepts=([], None)),
    refused(f"{ARR}.model.lora_adapter_path", "adapters start fresh in rlcore (no saved adapter is loaded)",
            "actor.lora.rank", accepts=(None,)),
    refused(f"{ARR}.model.mtp.enable", "multi-token prediction layers are not trained", "(none)", accepts=(False,)),
    ignored(f"{ARR}.model.mtp.*", "used only with mtp.enable=True (refused)"),
    ignored(f"{ARR}.model.use_shm", "rlcore reads checkpoints from their directory"),
    ignored(f"{ARR}.model.use_liger", KERNEL_TUNING),
    ignored(f"{ARR}.model.fused_kernel_options.*", KERNEL_TUNING),
    ignored(f"{ARR}.model.enable_activation_offload", "FSDP-only; Megatron's memory switch is actor.recompute",
            closest="actor.recompute"),
    ignored(f"{ARR}.model.torch_dtype", "FSDP-only; the Megatron actor's dtype is actor.dtype", closest="actor.dtype"),
    ignored(f"{ARR}.model.enable_gradient_checkpointing", "FSDP-only; Megatron's is actor.recompute",
            closest="actor.recompute"),
    ignored(f"{ARR}.model.use_remove_padding", "FSDP-only; see actor.pack_sequences"),
    ignored(f"{ARR}.nccl_timeout", "rlcore's collectives use torch's default timeout"),
    ignored(f"{ARR}.hybrid_engine", "rlcore colocates the engine with the trainer (trainer.mode=colocated)",
            accepts=(True,)),
    # --- actor --------------------------------------------------------------------------------------------------
    *megatron_rows(A, "actor"),
    *optim_rows(A, "actor"),
    grouped(f"{A}.ppo_mini_batch_size", "batch", ("actor.mini_batches",),
            "prompts per update: actor.mini_batches = train_batch_size / ppo_mini_batch_size",
            ("256", {"actor.mini_batches": 4}), needs=("data.train_batch_size=1024",)),
    mapped(f"{A}.ppo_micro_batch_size_per_gpu", "actor.micro_batch_size", one(as_int), "sequences per forward/backward",
           ("4", {"actor.micro_batch_size": 4})),
    refused(f"{A}.ppo_micro_batch_size", "a global micro-batch size (deprecated in verl)", "actor.micro_batch_size",
            accepts=(None,)),
    grouped(f"{A}.use_dynamic_bsz", "actor_tokens", ("actor.max_tokens_per_micro_batch", "actor.pack_sequences"),
            "micro-batches by a token budget: ppo_max_token_len_per_gpu tokens each, sequences packed without "
            "padding (as verl's remove-padding path; padded when context parallel)",
            ("True", {"actor.max_tokens_per_micro_batch": 10240, "actor.pack_sequences": True}),
            needs=(f"{A}.ppo_max_token_len_per_gpu=10240",)),
    grouped(f"{A}.ppo_max_token_len_per_gpu", "actor_tokens", ("actor.max_tokens_per_micro_batch",),
            "the token budget of a micro-batch, with use_dynamic_bsz=True (else unused, as in verl)",
            ("16384", {}), needs=()),
    mapped(f"{A}.ppo_epochs", "actor.epochs", one(as_int), "passes over each rollout batch",
           ("2", {"actor.epochs": 2})),
    refused(f"{A}.shuffle", "rlcore takes a batch's mini-batches in order", "actor.epochs", accepts=(False,)),
    ignored(f"{A}.data_loader_seed", "rlcore seeds from run.seed", closest="run.seed"),
    grouped(f"{A}.clip_ratio", "clip", ("algorithm.clip_ratio_low", "algorithm.clip_ratio_high"),
            "both clip bounds, unless clip_ratio_low/high are given",
            ("0.25", {"algorithm.clip_ratio_low": 0.25, "algorithm.clip_ratio_high": 0.25})),
    grouped(f"{A}.clip_ratio_low", "clip", ("algorithm.clip_ratio_low",), "PPO clip, lower",
            ("0.2", {"algorithm.clip_ratio_low": 0.2})),
    grouped(f"{A}.clip_ratio_high", "clip", ("algorithm.clip_ratio_high",), "PPO clip, upper (DAPO's clip-higher)",
            ("0.28", {"algorithm.clip_ratio_high": 0.28})),
    mapped(f"{A}.clip_ratio_c", "algorithm.clip_ratio_c", one(as_float), "dual-clip constant (verl's default 3.0 "
           "is not applied: rlcore's default is off)", ("10.0", {"algorithm.clip_ratio_c": 10.0})),
    mapped(f"{A}.loss_agg_mode", "algorithm.loss_agg_mode",
           choice({m: m for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm")}, "algorithm.loss_agg_mode"),
           "how token losses are averaged (the same four modes)", ("seq-mean-token-mean",
                                                                   {"algorithm.loss_agg_mode": "seq-mean-token-mean"})),
    mapped(f"{A}.entropy_coeff", "actor.entropy_coef", one(as_float), "entropy bonus",
           ("0.001", {"actor.entropy_coef": 0.001})),
    ignored(f"{A}.calculate_entropy", LOGGING),
    grouped(f"{A}.use_kl_loss", "kl", ("algorithm.kl_coef", "algorithm.kl_as"),
            "True: KL to the reference in the loss, algorithm.kl_coef = kl_loss_coef (PPO: kl_as=loss)",
            ("True", {"algorithm.kl_coef": 0.001}), needs=(f"{A}.kl_loss_coef=0.001",)),
    grouped(f"{A}.kl_loss_coef", "kl", ("algorithm.kl_coef",), "with use_kl_loss=True (else unused, as in verl)",
            None),
    grouped(f"{A}.kl_loss_type", "kl", ("algorithm.kl_estimator",),
            "the KL estimator: low_var_kl = k3, kl = k1, mse = k2",
            ("low_var_kl", {"algorithm.kl_estimator": "k3"})),
    refused(f"{A}.policy_loss.loss_mode", "rlcore's policy loss is the clipped surrogate (verl's vanilla)",
            "algorithm.name", accepts=("vanilla",)),
    ignored(f"{A}.policy_loss.*", "options of verl's other policy losses (loss_mode must be vanilla)"),
    ignored(f"{A}.tau_pos", "an option of verl's other policy losses"),
    ignored(f"{A}.tau_neg", "an option of verl's other policy losses"),
    refused(f"{A}.loss_scale_factor", "rlcore normalises the loss by loss_agg_mode only", "algorithm.loss_agg_mode",
            accepts=(None,)),
    ignored(f"{A}.use_torch_compile", KERNEL_TUNING),
    ignored(f"{A}.use_fused_kernels", KERNEL_TUNING),
    ignored(f"{A}.use_prefix_grouper", ENGINE_TUNING, accepts=(False,)),
    mapped(f"{A}.freeze_vision_tower", "actor.freeze", one(lambda v: ["vision_tower"] if as_bool(v) else []),
           "the vision tower trained on as loaded (the projector and the language model train)",
           ("True", {"actor.freeze": ["vision_tower"]})),
    ignored(f"{A}.checkpoint.*", "rlcore checkpoints model, optimizer and run state together",
            closest="trainer.save_every"),
    ignored(f"{A}.profiler.*", PROFILER),
    mapped(f"{A}.router_replay.mode", "actor.moe.routing_replay",
           choice({"disabled": "off", "R3": "rollout"}, "actor.moe.routing_replay"),
           "R3: the learner's MoE layers use the experts the rollout engine chose (R2, routes recorded in the "
           "learner's own old-logprob pass, has no rlcore counterpart)",
           ("R3", {"actor.moe.routing_replay": "rollout"})),
    ignored(f"{A}.router_replay.*", "verl's route files and recorder options; rlcore takes the routes from the engine"),
    ignored(f"{A}.strategy", "rlcore trains with Megatron", accepts=("megatron",)),
    ignored(f"{A}.fsdp_config.*", "FSDP-only: rlcore trains with Megatron"),
    *[ignored(f"{v}.ulysses_sequence_parallel_size", "FSDP-only; Megatron's context parallel is cp",
              closest=f"{s}.parallel.cp") for v, s in ((A, "actor"), (REF, "actor"), ("critic", "critic"))],
    mapped(f"{A}.grad_clip", "actor.optim.clip_grad", one(as_float), "verl's older name of optim.clip_grad",
           ("1.0", {"actor.optim.clip_grad": 1.0})),
    *[ignored(f"{v}.{k}", "rlcore computes the entropy in chunks of actor.logprob_chunk_tokens",
              closest="actor.logprob_chunk_tokens")
      for v in (A, REF) for k in ("entropy_checkpointing", "entropy_from_logits_with_chunking")],
    ignored(f"{REF}.use_torch_compile", KERNEL_TUNING),
    ignored(f"{A}.calculate_sum_pi_squared", LOGGING),
    # --- reference ----------------------------------------------------------------------------------------------
    *[grouped(f"{REF}.megatron.{k}", "ref_layout", (), SAME_LAYOUT, (v, {}), needs=(f"{A}.megatron.{k}={v}",))
      for k, v in (("tensor_model_parallel_size", "2"), ("pipeline_model_parallel_size", "2"),
                   ("expert_model_parallel_size", "2"), ("expert_tensor_parallel_size", "1"),
                   ("context_parallel_size", "2"), ("virtual_pipeline_model_parallel_size", "null"),
                   ("sequence_parallel", "True"))],
    mapped(f"{REF}.megatron.param_offload", "actor.offload.reference", one(as_bool),
           "the reference policy on the host between its passes", ("True", {"actor.offload.reference": True})),
    ignored(f"{REF}.megatron.*", "the reference is built as the actor is"),
    ignored(f"{REF}.log_prob_micro_batch_size_per_gpu", "log-prob passes use the actor's micro-batching",
            closest="actor.micro_batch_size"),
    ignored(f"{REF}.log_prob_micro_batch_size", "log-prob passes use the actor's micro-batching",
            closest="actor.micro_batch_size"),
    ignored(f"{REF}.log_prob_use_dynamic_bsz", "log-prob passes use the actor's micro-batching",
            closest="actor.max_tokens_per_micro_batch"),
    ignored(f"{REF}.log_prob_max_token_len_per_gpu", "log-prob passes use the actor's micro-batching",
            closest="actor.max_tokens_per_micro_batch"),
    ignored(f"{REF}.profiler.*", PROFILER),
    ignored(f"{REF}.strategy", "rlcore trains with Megatron", accepts=("megatron",)),
    ignored(f"{REF}.fsdp_config.*", "FSDP-only: rlcore trains with Megatron"),
    # --- rollout ------------------------------------------------------------------------------------------------
    mapped(f"{R}.name", "rollout.backend", choice({"vllm": "vllm", "sglang": "sglang"}, "rollout.backend"),
           "the rollout engine", ("sglang", {"rollout.backend": "sglang"})),
    mapped(f"{R}.n", "rollout.n", one(as_int), "responses per prompt", ("8", {"rollout.n": 8})),
    mapped(f"{R}.temperature", "rollout.temperature", one(as_float), "sampling temperature",
           ("0.9", {"rollout.temperature": 0.9})),
    refused(f"{R}.top_p", "rlcore samples from the whole distribution (top_p 1)", "rollout.temperature",
            accepts=(1, 1.0)),
    refused(f"{R}.top_k", "rlcore samples from the whole distribution (top_k -1)", "rollout.temperature",
            accepts=(-1, 0)),
    mapped(f"{R}.tensor_model_parallel_size", "rollout.tp", one(as_int), "the engine's tensor parallel size",
           ("4", {"rollout.tp": 4})),
    refused(f"{R}.data_parallel_size", "engine replicas follow from trainer.world_size / rollout.tp", "rollout.tp",
            accepts=(1,)),
    refused(f"{R}.expert_parallel_size", "the engine shards experts with its tensor parallel size", "rollout.tp",
            accepts=(1,)),
    refused(f"{R}.pipeline_model_parallel_size", "the engine runs without pipeline parallelism", "rollout.tp",
            accepts=(1,)),
    ignored(f"{R}.gpu_memory_utilization", "rlcore reserves a fixed KV cache instead of a share of the device",
            closest="rollout.kv_cache_gib"),
    ignored(f"{R}.mode", "verl's sync/async engine server; rlcore's colocated engine serves the same batch "
            "(rlcore's async training is trainer.mode=async)", closest="trainer.mode"),
    ignored(f"{R}.calculate_log_probs", "rlcore always keeps the engine's log-probs", closest="actor.old_logprobs"),
    grouped(f"{R}.val_kwargs.temperature", "eval", ("trainer.eval_temperature",),
            "held-out sampling temperature, with val_kwargs.do_sample=True (greedy otherwise, as in verl)",
            ("0.6", {"trainer.eval_temperature": 0.6}), needs=(f"{R}.val_kwargs.do_sample=True",)),
    grouped(f"{R}.val_kwargs.do_sample", "eval", ("trainer.eval_temperature",),
            "False: greedy held-out responses (eval_temperature 0)", ("False", {"trainer.eval_temperature": 0.0})),
    mapped(f"{R}.val_kwargs.n", "trainer.eval_n", one(as_int), "responses per held-out prompt (mean@n, pass@n)",
           ("1", {"trainer.eval_n": 1})),
    ignored(f"{R}.val_kwargs.top_p", "held-out responses are sampled from the whole distribution in rlcore",
            closest="trainer.eval_temperature"),
    ignored(f"{R}.val_kwargs.top_k", "held-out responses are sampled from the whole distribution in rlcore",
            closest="trainer.eval_temperature"),
    mapped(f"{R}.checkpoint_engine.update_weights_bucket_megabytes", "rollout.sync_bucket_mb", one(as_float),
           "weight sync bucket size", ("512", {"rollout.sync_bucket_mb": 512.0})),
    *[ignored(f"{R}.{k}", ENGINE_TUNING) for k in (
        "enforce_eager", "enable_chunked_prefill", "free_cache_engine", "max_num_batched_tokens", "max_num_seqs",
        "max_model_len", "cudagraph_capture_sizes", "load_format", "dtype", "disable_log_stats",
        "enable_prefix_caching",
        "engine_kwargs.*", "layered_summon", "ignore_eos", "do_sample")],
    *[ignored(f"{R}.{k}", ENGINE_TUNING) for k in ("multi_stage_wake_up", "over_sample_rate", "skip_tokenizer_init",
                                                   "trace.*", "prometheus.*")],
    refused(f"{R}.enable_rollout_routing_replay", "MoE router replay is not supported", "(none)", accepts=(False,)),
    ignored(f"{R}.log_prob_micro_batch_size_per_gpu", "log-prob passes use the actor's micro-batching",
            closest="actor.micro_batch_size"),
    ignored(f"{R}.log_prob_micro_batch_size", "log-prob passes use the actor's micro-batching",
            closest="actor.micro_batch_size"),
    ignored(f"{R}.log_prob_use_dynamic_bsz", "log-prob passes use the actor's micro-batching",
            closest="actor.max_tokens_per_micro_batch"),
    ignored(f"{R}.log_prob_max_token_len_per_gpu", "log-prob passes use the actor's micro-batching",
            closest="actor.max_tokens_per_micro_batch"),
    refused(f"{R}.multi_turn.enable", "multi-turn episodes run through rlcore's tools agent", "rollout.agent=tools",
            accepts=(False,)),
    mapped(f"{R}.multi_turn.tool_config_path", ("rollout.agent", "agent.environment", "agent.options"),
           lambda v: ("tools", "verl_tools", {"tool_config_path": as_str(v)}),
           "verl's tool config, run by rlcore's tools agent", ("/t.yaml", {
               "rollout.agent": "tools", "agent.environment": "verl_tools",
               "agent.options": {"tool_config_path": "/t.yaml"}})),
    mapped(f"{R}.multi_turn.max_assistant_turns", "agent.max_turns", one(as_int), "assistant turns per episode",
           ("5", {"agent.max_turns": 5})),
    mapped(f"{R}.multi_turn.max_parallel_calls", "agent.max_parallel_calls", one(as_int), "tool calls per turn",
           ("2", {"agent.max_parallel_calls": 2})),
    mapped(f"{R}.multi_turn.max_tool_response_length", "agent.max_tool_response_tokens", one(as_int),
           "a longer tool result is cut in the middle", ("256", {"agent.max_tool_response_tokens": 256})),
    mapped(f"{R}.multi_turn.format", "agent.parser", choice({"hermes": "hermes"}, "agent.parser"),
           "how tool calls are written", ("hermes", {"agent.parser": "hermes"})),
    ignored(f"{R}.multi_turn.*", "a multi-turn option rlcore's tools agent does not have", closest="agent"),
    ignored(f"{R}.profiler.*", PROFILER),
    # --- critic -------------------------------------------------------------------------------------------------
    *megatron_rows("critic", "critic"),
    *optim_rows("critic", "critic"),
    mapped("critic.model.path", "critic.model_path", one(as_str), "the value model's starting checkpoint",
           ("/ckpt/q", {"critic.model_path": "/ckpt/q"})),
    refused("critic.model.lora.rank", "rlcore adapts the actor only", "actor.lora.rank", accepts=(0,)),
    refused("critic.model.lora_rank", "rlcore adapts the actor only", "actor.lora.rank", accepts=(0,)),
    ignored("critic.model.lora.*", "used only with critic.model.lora.rank > 0 (refused)"),
    ignored("critic.model.trust_remote_code", "rlcore reads config.json itself and runs no remote code"),
    ignored("critic.model.*", "the critic is built as the actor's family"),
    mapped("critic.ppo_micro_batch_size_per_gpu", "critic.micro_batch_size", one(as_int),
           "sequences per forward/backward", ("4", {"critic.micro_batch_size": 4})),
    grouped("critic.ppo_mini_batch_size", "batch", ("critic.mini_batches",),
            "prompts per update: critic.mini_batches = train_batch_size / ppo_mini_batch_size",
            ("256", {"critic.mini_batches": 4}), needs=("data.train_batch_size=1024",)),
    mapped("critic.ppo_epochs", "critic.epochs", one(as_int), "passes over each rollout batch",
           ("2", {"critic.epochs": 2})),
    grouped("critic.use_dynamic_bsz", "critic_tokens", ("critic.max_tokens_per_micro_batch", "critic.pack_sequences"),
            "as the actor's", ("True", {"critic.max_tokens_per_micro_batch": 8192, "critic.pack_sequences": True}),
            needs=("critic.ppo_max_token_len_per_gpu=8192",)),
    grouped("critic.ppo_max_token_len_per_gpu", "critic_tokens", ("critic.max_tokens_per_micro_batch",),
            "with use_dynamic_bsz=True", None),
    ignored("critic.forward_max_token_len_per_gpu", "value passes use the critic's micro-batching",
            closest="critic.max_tokens_per_micro_batch"),
    mapped("critic.cliprange_value", "algorithm.value_clip", one(as_float), "value clipping (PPO)",
           ("0.5", {"algorithm.value_clip": 0.5})),
    ignored("critic.loss_agg_mode", "the value loss is averaged over tokens", accepts=("token-mean",)),
    ignored("critic.profiler.*", PROFILER),
    ignored("critic.checkpoint.*", "rlcore checkpoints model, optimizer and run state together",
            closest="trainer.save_every"),
    ignored("critic.strategy", "rlcore trains with Megatron", accepts=("megatron",)),
    ignored("critic.nccl_timeout", "rlcore's collectives use torch's default timeout"),
    # --- reward -------------------------------------------------------------------------------------------------
    grouped("custom_reward_function.path", "reward_fn", ("task.reward_fn",), "path:name, a verl compute_score",
            ("/r.py", {"task.reward_fn": "/r.py:compute_score"})),
    grouped("custom_reward_function.name", "reward_fn", ("task.reward_fn",), "the function in path",
            ("my_score", {"task.reward_fn": "/r.py:my_score"}), needs=("custom_reward_function.path=/r.py",)),
    ignored("custom_reward_function.reward_kwargs.*", "rlcore calls compute_score with verl's arguments only",
            accepts=()),
    mapped("reward_model.reward_manager", (), choice({"naive": None, "dapo": None}, "task.reward_fn"),
           "naive and dapo score each row by its data_source reward, as rlcore does (dapo's overlong penalty: "
           "reward_kwargs.overlong_buffer_cfg); with reward_model.enable=True both pass the reward model's score on "
           "as the reward", ("dapo", {})),
    grouped("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "overlong",
            ("algorithm.overlong_buffer", "algorithm.overlong_max_len", "algorithm.overlong_penalty"),
            "DAPO's soft overlong penalty (GRPO): linear over the last len tokens before max_resp_len",
            ("True", {"algorithm.overlong_buffer": 4096, "algorithm.overlong_max_len": 8192,
                      "algorithm.overlong_penalty": 1.0}),
            needs=("reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096",
                   "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                   "+reward_model.reward_kwargs.max_resp_len=8192")),
    grouped("reward_model.reward_kwargs.overlong_buffer_cfg.len", "overlong", ("algorithm.overlong_buffer",),
            "with enable=True", None),
    grouped("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor", "overlong",
            ("algorithm.overlong_penalty",), "with enable=True", None),
    grouped("reward_model.reward_kwargs.max_resp_len", "overlong", ("algorithm.overlong_max_len",),
            "with enable=True", None),
    ignored("reward_model.reward_kwargs.overlong_buffer_cfg.log", LOGGING),
    *reward_model_rows(),
    # --- algorithm ----------------------------------------------------------------------------------------------
    mapped("algorithm.adv_estimator", "algorithm.name",
           choice({"grpo": "grpo", "gae": "ppo", "rloo": "rloo"}, "algorithm.name"),
           "grpo -> grpo, gae (PPO) -> ppo, rloo -> rloo", ("gae", {"algorithm.name": "ppo"})),
    mapped("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std", one(as_bool),
           "False: Dr. GRPO's unscaled advantages", ("False", {"algorithm.norm_adv_by_std": False})),
    mapped("algorithm.gamma", "algorithm.gamma", one(as_float), "discount (PPO)", ("0.99", {"algorithm.gamma": 0.99})),
    mapped("algorithm.lam", "algorithm.lam", one(as_float), "GAE lambda (PPO)", ("0.95", {"algorithm.lam": 0.95})),
    grouped("algorithm.use_kl_in_reward", "kl", ("algorithm.kl_coef", "algorithm.kl_as"),
            "True: KL penalty in the reward, algorithm.kl_coef = kl_ctrl.kl_coef (PPO only)",
            ("True", {"algorithm.kl_coef": 0.01, "algorithm.kl_as": "reward"}),
            needs=("algorithm.kl_ctrl.kl_coef=0.01", "algorithm.adv_estimator=gae")),
    grouped("algorithm.kl_ctrl.kl_coef", "kl", ("algorithm.kl_coef",), "with use_kl_in_reward=True", None),
    grouped("algorithm.kl_ctrl.type", "kl", ("algorithm.kl_target",), "fixed, or adaptive toward target_kl",
            None),
    grouped("algorithm.kl_ctrl.target_kl", "kl", ("algorithm.kl_target",), "with kl_ctrl.type=adaptive", None),
    grouped("algorithm.kl_ctrl.horizon", "kl", ("algorithm.kl_horizon",), "with kl_ctrl.type=adaptive", None),
    grouped("algorithm.kl_penalty", "kl", ("algorithm.kl_estimator",),
            "the in-reward KL estimator, with use_kl_in_reward=True", None),
    mapped("algorithm.filter_groups.enable", "algorithm.dynamic_sampling", one(as_bool),
           "DAPO's dynamic sampling: groups whose rewards are all equal are dropped and more prompts sampled",
           ("True", {"algorithm.dynamic_sampling": True})),
    mapped("algorithm.filter_groups.max_num_gen_batches", "rollout.max_sampling_rounds",
           lambda v: (as_int(v) if as_int(v) > 0 else 4,),
           "rounds of sampling a step may take (verl's <= 0, no limit, is rlcore's default 4)",
           ("10", {"rollout.max_sampling_rounds": 10})),
    ignored("algorithm.filter_groups.metric", "rlcore compares the groups' rewards (verl's score / seq_reward)",
            accepts=("acc", "score", "seq_reward", "seq_final_reward", None)),
    ignored("data.gen_batch_size", "with dynamic sampling rlcore samples rounds of train_batch_size prompts",
            closest="rollout.max_sampling_rounds"),
    ignored("data.image_key", "rlcore trains text-only models: no images are read"),
    refused("data.sampler.*", "custom prompt samplers are not loaded", "task.options.shuffle", accepts=(None,)),
    refused("algorithm.use_pf_ppo", "preference-feedback PPO is not supported", "algorithm.name", accepts=(False,)),
    ignored("algorithm.pf_ppo.*", "used only with use_pf_ppo=True (refused)"),
    # rollout correction: verl's decoupled mode (bypass_mode False) recomputes the old policy, as rlcore's
    # actor.old_logprobs=actor; bypass takes the engine's log-probs as the old policy, as actor.old_logprobs=rollout
    mapped("algorithm.rollout_correction.rollout_is", "algorithm.rollout_is",
           choice({None: "none", "token": "token", "sequence": "sequence"}, "algorithm.rollout_is"),
           "truncated importance weights pi_trainer / pi_rollout, per token or sequence",
           ("token", {"algorithm.rollout_is": "token"})),
    mapped("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_is_threshold", one(as_float),
           "the truncation C", ("2.0", {"algorithm.rollout_is_threshold": 2.0})),
    grouped("algorithm.rollout_correction.rollout_rs", "rs", ("algorithm.rollout_rs_low", "algorithm.rollout_rs_high"),
            "seq_mean_k1: reject sequences whose geometric-mean ratio leaves [lower, upper] (rlcore's rejection); "
            "other statistics refused", ("seq_mean_k1", {"algorithm.rollout_rs_low": 0.5, "algorithm.rollout_rs_high":
                                                         2.0}),
            needs=("algorithm.rollout_correction.rollout_rs_threshold=2.0",)),
    grouped("algorithm.rollout_correction.rollout_rs_threshold", "rs",
            ("algorithm.rollout_rs_low", "algorithm.rollout_rs_high"),
            "upper, or lower_upper (lower defaults to 1/upper, as in verl)",
            ("0.8_1.25", {"algorithm.rollout_rs_low": 0.8, "algorithm.rollout_rs_high": 1.25}),
            needs=("algorithm.rollout_correction.rollout_rs=seq_mean_k1",)),
    mapped("algorithm.rollout_correction.bypass_mode", "actor.old_logprobs",
           choice({False: "actor", True: "rollout"}, "actor.old_logprobs"),
           "True: the engine's log-probs are the old policy (no recompute)",
           ("True", {"actor.old_logprobs": "rollout"})),
    refused("algorithm.rollout_correction.loss_type", "the policy loss is PPO's clipped surrogate",
            "actor.old_logprobs", accepts=("ppo_clip",)),
    refused("algorithm.rollout_correction.rollout_is_batch_normalize", "importance weights are not renormalised "
            "over the batch", "algorithm.rollout_is_threshold", accepts=(False,)),
    # --- trainer ------------------------------------------------------------------------------------------------
    grouped("trainer.n_gpus_per_node", "world", ("trainer.devices_per_node", "trainer.world_size"),
            "devices per node; trainer.world_size = nnodes x n_gpus_per_node",
            ("8", {"trainer.devices_per_node": 8, "trainer.world_size": 8})),
    grouped("trainer.nnodes", "world", ("trainer.world_size",), "nodes; with n_gpus_per_node",
            ("12", {"trainer.devices_per_node": 8, "trainer.world_size": 96}), needs=("trainer.n_gpus_per_node=8",)),
    grouped("trainer.total_training_steps", "steps", ("trainer.steps",), "RL steps (wins over total_epochs)",
            ("500", {"trainer.steps": 500})),
    grouped("trainer.total_epochs", "steps", ("trainer.steps",),
            "epochs x (training rows // train_batch_size) when the training files are on this machine; "
            "ignored otherwise (set trainer.steps)", None),
    mapped("trainer.test_freq", "trainer.eval_every", steps_or_off, "steps between evaluations (-1: never)",
           ("10", {"trainer.eval_every": 10})),
    mapped("trainer.save_freq", "trainer.save_every", steps_or_off, "steps between checkpoints (-1: never)",
           ("100", {"trainer.save_every": 100})),
    mapped("trainer.max_actor_ckpt_to_keep", "trainer.keep_checkpoints", one(as_int), "checkpoints kept",
           ("3", {"trainer.keep_checkpoints": 3})),
    mapped("trainer.default_local_dir", "run.dir", one(as_str), "where the run (its checkpoints too) goes",
           ("/ckpt/run", {"run.dir": "/ckpt/run"})),
    grouped("trainer.resume_mode", "resume", ("trainer.resume",), "auto: continue from the run directory's newest "
            "checkpoint if any; disable: start fresh; resume_path: from resume_from_path",
            ("auto", {"trainer.resume": "auto"})),
    grouped("trainer.resume_from_path", "resume", ("trainer.resume",), "a checkpoint directory, with "
            "resume_mode=resume_path", ("/ckpt/run/checkpoints/step_10",
                                        {"trainer.resume": "/ckpt/run/checkpoints/step_10"}),
            needs=("trainer.resume_mode=resume_path",)),
    mapped("trainer.critic_warmup", "critic.warmup_steps", one(as_int), "steps training only the critic",
           ("5", {"critic.warmup_steps": 5})),
    mapped("trainer.logger", "trainer.loggers", lambda v: (["console", "jsonl"],),
           "console and metrics.jsonl; wandb, tensorboard and the rest are not rlcore loggers",
           ("['console','wandb']", {"trainer.loggers": ["console", "jsonl"]})),
    mapped("trainer.max_ckpt_to_keep", "trainer.keep_checkpoints", one(as_int), "checkpoints kept",
           ("2", {"trainer.keep_checkpoints": 2})),
    ignored("trainer.max_critic_ckpt_to_keep", "a checkpoint holds actor and critic together",
            closest="trainer.keep_checkpoints"),
    ignored("trainer.use_legacy_worker_impl", "verl's choice of its own worker classes"),
    ignored("trainer.project_name", LOGGING),
    ignored("trainer.experiment_name", LOGGING),
    ignored("trainer.log_val_generations", LOGGING),
    ignored("trainer.val_before_train", "rlcore always evaluates before and after RL (the summary's before/after)"),
    ignored("trainer.val_only", "rlcore evaluates as part of a run", accepts=(False,)),
    ignored("trainer.device", "rlcore uses CUDA when present, else the CPU", accepts=("cuda",)),
    ignored("trainer.balance_batch", "rlcore balances micro-batches by actor.max_tokens_per_micro_batch"),
    ignored("trainer.ray_wait_register_center_timeout", "Ray start-up is rlcore's own"),
    ignored("trainer.del_local_ckpt_after_load", "rlcore keeps its checkpoints", accepts=(False,)),
    ignored("trainer.rollout_data_dir", LOGGING, accepts=(None,)),
    ignored("trainer.validation_data_dir", LOGGING, accepts=(None,)),
    ignored("trainer.esi_redundant_time", "an elastic-instance option of verl's platform"),
    ignored("ray_kwargs.*", "rlcore starts (or joins: trainer.ray_address) Ray itself", closest="trainer.ray_address"),
    ignored("global_profiler.*", PROFILER),
    ignored("transfer_queue.*", "verl's transfer queue; rlcore moves batches itself"),
]


# verl defaults that differ from rlcore's and that a verl run depends on, applied when the command line gives any
# key under the prefix but not the key itself: verl's Megatron strategy trains in bfloat16, rlcore's default is fp32
IMPLIED: dict[str, tuple[str, str]] = {f"{A}.megatron.dtype": ("bfloat16", f"{ARR}."),
                                       "critic.megatron.dtype": ("bfloat16", "critic.")}


def key_names() -> list[str]:
    """The verl keys of the table, for did-you-mean (wildcards without their '.*')."""
    return [k.verl[:-2] if k.verl.endswith(".*") else k.verl for k in TABLE]


def lookup(verl_key: str) -> Key | None:
    """The row for a verl key: its own, else the nearest wildcard above it."""
    exact = {k.verl: k for k in TABLE if not k.verl.endswith(".*")}
    if verl_key in exact:
        return exact[verl_key]
    best: Key | None = None
    for k in TABLE:
        if k.verl.endswith(".*") and verl_key.startswith(k.verl[:-1]):
            if best is None or len(k.verl) > len(best.verl):
                best = k
    return best

"""The run configuration: structured dataclasses, one documented field per key.

Plugin-owned sections (``algorithm`` options, ``task.options``) are free-form here and validated against the
plugin's own dataclass once plugins are loaded (``rlcore.config.loader.bind_plugin_sections``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class RunConfig:
    dir: str = ""                 # where metrics, plots and exports go; empty = runs/<timestamp>
    seed: int = 0                 # seeds model init, prompt sampling and rollout sampling
    progress: bool = True         # show a progress bar


@dataclass
class TinyModelConfig:
    """Sizes of the built-in tiny model, used when model.path is empty."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32            # vLLM's CPU attention needs 32, 64, 80, 96, 112, 128, 160, 192, 224 or 256
    ffn_hidden_size: int = 512
    max_position_embeddings: int = 512


@dataclass
class ModelConfig:
    family: str = "qwen3"         # a registered model plugin (see `rlcore plugins`)
    path: str = ""                # HF checkpoint directory; empty = build the tiny model for the task
    hf_config: str = ""           # sizes for `--dry-run` without a checkpoint: a config.json path, or a bundled
                                  # name (deepseek-v3, moonlight-16b-a3b, qwen3-235b-a22b, qwen3-30b-a3b)
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


@dataclass
class WarmStartConfig:
    """A short supervised warm start on the task's examples before RL, cached by its settings."""
    steps: int = 0                # the most steps it takes (cosine LR decay over them); 0 = no warm start
    lr: float = 1e-3              # AdamW's peak learning rate
    batch_size: int = 64
    target_accuracy: float = 0.0  # stop at the first evaluation with this greedy held-out accuracy (eval/accuracy);
                                  # not reached in `steps`: an error. 0 = no evaluations, all `steps`
    eval_every: int = 25          # steps between the held-out evaluations (with a target_accuracy)
    cache_dir: str = "~/.cache/rlcore/warm_start"


@dataclass
class OptimConfig:
    name: str = "adam"            # a registered optimizer
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0      # optimizer updates over which the LR rises linearly to lr
    lr_schedule: str = "constant"  # after warm-up: constant | cosine | linear (to min_lr by the run's last update)
    min_lr: float = 0.0           # where cosine / linear decay ends
    offload_fraction: float = 0.0  # name=hybrid_adam (Megatron's hybrid CPU/GPU optimizer): share of each rank's
                                   # optimizer state held and stepped on the host, 0 < f <= 1 (whole parameters)


@dataclass
class ParallelConfig:
    tp: int = 1                   # tensor parallel size
    pp: int = 1                   # pipeline parallel size
    ep: int = 1                   # expert parallel size (MoE models; taken out of the data-parallel ranks)
    cp: int = 1                   # context parallel size: each sequence split over cp ranks
    sp: bool = False              # sequence parallelism inside TP regions (norms, dropout); needs tp > 1
    last_stage_layers: int = 0    # decoder layers on the last pipeline stage (0 = split evenly); the other stages
                                  # share the rest evenly (e.g. DeepSeek-V3's 61 layers at pp=16: 15 x 4 + 1)


@dataclass
class OffloadConfig:
    """What a model moves to host memory while it is idle: the actor while the rollout engine runs, the critic
    outside its own passes (frees accelerator memory for the others)."""
    params: bool = False
    grads: bool = False
    optimizer: bool = False


@dataclass
class ActorOffloadConfig(OffloadConfig):
    reference: Optional[bool] = None   # the frozen reference policy (KL terms) on the host between its passes;
                                  # unset = as params

    def reference_on_host(self) -> bool:
        return self.params if self.reference is None else self.reference


@dataclass
class TrainedModelConfig:
    """What every trained Megatron model (actor, critic) sets: batching, precision, optimizer, layout, offload."""
    micro_batch_size: int = 64    # sequences per forward/backward pass
    max_tokens_per_micro_batch: int = 0   # > 0: instead, micro-batches of rows of similar length, at most this many
                                  # tokens each counting padding (fewer padded tokens for long-tailed responses)
    pack_sequences: bool = False  # with max_tokens_per_micro_batch: each micro-batch's sequences end to end in one
                                  # row, no padding, attention kept within each (the budget then counts tokens)
    mini_batches: int = 1         # optimizer updates per rollout batch
    epochs: int = 1               # passes over each rollout batch
    dtype: str = "float32"        # float32 | bfloat16
    recompute: str = "none"       # none | selective | full: activations recomputed in the backward pass instead of
                                  # kept (selective: core attention; full: every transformer layer's input only)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class LoRASection:
    """Low-rank adapters on the actor's linears (``rlcore.lora.layers``): the base weights frozen, only the
    adapters trained; the reference policy is the model with its adapters off."""
    rank: int = 0                 # 0 = off (full fine-tuning); e.g. 16
    alpha: float = 32.0           # the adapters' scale is alpha / rank (PEFT's)
    dropout: float = 0.0          # on the adapters' input, in [0, 1)
    target_modules: List[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1",
                                                               "linear_fc2"])   # megatron-core's linear names


@dataclass
class MoESection:
    """Mixture-of-experts options of the actor (``rlcore.megatron.routing_replay``)."""
    routing_replay: str = "off"   # rollout: the learner's MoE layers send each token to the experts the rollout
                                  # engine chose (its router gradients still flow through their scores); off
    measure_live_routing: bool = True   # with replay: one more forward pass per step, routed live, for the metrics
                                  # routing/* (how often the learner's own routing differs from the engine's, and
                                  # the logprob mismatch without replay)


@dataclass
class ActorConfig(TrainedModelConfig):
    offload: ActorOffloadConfig = field(default_factory=ActorOffloadConfig)
    lora: LoRASection = field(default_factory=LoRASection)
    moe: MoESection = field(default_factory=MoESection)
    freeze: List[str] = field(default_factory=list)   # parts trained on as loaded, with no gradients or optimizer
                                  # state (rlcore.model_parts): vision_tower, projector (a vision-language model's)
                                  # and language_model; e.g. [vision_tower] trains the projector and the LM
    entropy_coef: float = 0.0     # entropy bonus: the loss subtracts this times the policy's token-mean entropy
    logprob_chunk_tokens: int = 4096  # the output layer, log-probabilities and entropy run on this many tokens at a
                                  # time, so [tokens x vocab] logits exist one chunk at a time (0 = all at once)
    old_logprobs: str = "auto"    # the old policy in the clipped ratio: actor = the trainer's (a forward pass before
                                  # the update when a batch gets several updates); rollout = the engine's own from
                                  # sampling (no pass; the ratio then carries the engine-trainer mismatch and the
                                  # staleness too, and is clipped with them); auto = rollout in async mode with
                                  # max_staleness > 0 unless algorithm sets a correction key, else actor


@dataclass
class CriticConfig(TrainedModelConfig):
    """The value model of algorithms that learn one (PPO): a Megatron model of the actor's family whose output
    layer is replaced by a scalar value head. Its workers are its own processes, with their own layout."""
    model_path: str = ""          # HF checkpoint to start from; empty = the actor's (the value head starts at 0)
    world_size: int = 0           # critic worker processes; 0 = trainer.world_size
    warmup_steps: int = 0         # the first N steps train only the critic (the actor waits for useful values)


@dataclass
class JudgeConfig:
    """A generative judge (reward_model.kind=generative, ``rlcore.rollout.judge``): reward_model.path is a causal LM
    that reads a rubric rendered for each episode and writes a verdict, in which the parser finds the score. It
    runs on rollout engines of its own (reward_model.world_size of them, 0 = one), with fixed weights."""
    template: str = ""            # the rubric: inline text, or a file's path. {prompt} (the policy's prompt as it saw
                                  # it), {response} and {answer} (the row's metadata answer) are filled in per episode
    parser: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"   # a regex with one group: its first match in the
                                  # judge's answer is the score; no match fails the sample (counted in reward/failed)
    max_tokens: int = 64          # the judge's answer, at most
    temperature: float = 0.0      # 0 = greedy
    backend: str = ""             # a registered rollout backend for the judge; empty = rollout.backend
    kv_cache_gib: float = 0.0     # the judge engine's KV cache; 0 = rollout.kv_cache_gib
    chat: bool = False            # the rubric goes through the judge's chat template as one user message


@dataclass
class RewardModelConfig(TrainedModelConfig):
    """A learned reward: a sequence-classification checkpoint (one score per sequence, read at its last token) of a
    family rlcore has, on Megatron workers of its own with their own layout, scoring every finished episode (prompt
    and response) on the rollout side. Its score is the reward component ``name``. ``rlcore train-rm`` trains one
    with this section's layout, batching and optimizer. With kind=generative, path is instead a causal LM judge
    (``judge``), run by a rollout engine."""
    kind: str = "scalar"          # scalar: a sequence classifier (above); generative: a causal LM judge (judge.*)
    path: str = ""                # HF checkpoint (e.g. LlamaForSequenceClassification); empty = no reward model
    hf_config: str = ""           # sizes for `--dry-run` without a checkpoint: a config.json path, or a bundled name
                                  # (llama-3.1-70b-sequence-classifier); a run reads reward_model.path
    name: str = "rm"              # the reward component it gives: task.rewards={rm: 1.0, format: 0.1}; unnamed there,
                                  # the reward is rm alone and the task's own reward is logged beside it (weight 0)
    world_size: int = 0           # its worker processes; 0 = trainer.world_size (async: rollout.world_size);
                                  # generative: the judge's engines, a process each (0 = one)
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class RewardTrainingConfig:
    """A scalar reward model trained with the Bradley-Terry loss, -log sigmoid(r(chosen) - r(rejected)), on
    preference pairs: by ``rlcore train-rm``, or by ``rlcore run`` first when reward_model.path is empty and pairs are
    given here (then cached under warm_start.cache_dir, as the warm start is). Its layout, batching, precision and
    optimizer are reward_model.*'s; train-rm's checkpoints, resume and loggers are trainer.*'s."""
    train_files: List[str] = field(default_factory=list)   # Parquet rows of prompt, chosen, rejected (text, or chat
                                  # messages); verl's and OpenRLHF's column names are these
    val_files: List[str] = field(default_factory=list)     # held-out pairs; none: val_pairs from the training ones
    prompt_key: str = "prompt"    # empty: chosen and rejected hold the whole conversation
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    synthetic_pairs: int = 0      # instead of files: this many pairs made by the task (Task.preference_pairs)
    val_pairs: int = 256          # held-out pairs when there are no val_files
    pairs_per_step: int = 32      # pairs per optimizer update
    epochs: float = 1.0           # passes over the training pairs (train-rm's steps follow from it)
    eval_every: int = 50          # held-out pairwise accuracy every N steps, and after the last
    init_from: str = ""           # the checkpoint it starts from: a causal LM (its body; the score head starts at 0)
                                  # or a sequence classifier; empty = model.path (the run's starting policy)
    warm_start_accuracy: float = 0.0  # with model.path and init_from empty: start from the task's tiny model warm-
                                  # started to this held-out accuracy (a judge stronger than the policy; 0 = the
                                  # policy's own starting checkpoint)


@dataclass
class RolloutConfig:
    backend: str = "vllm"         # a registered rollout backend
    agent: str = "single_turn"    # a registered agent: how an episode uses the engine (one response, or turns)
    n: int = 8                    # samples per prompt (the GRPO group size)
    temperature: float = 1.0
    max_response_len: int = 8     # tokens
    kv_cache_gib: float = 0.25    # KV cache reserved by the engine (CPU engines cannot release it)
    tp: int = 1                   # rollout tensor parallel size (independent of training's); divides world_size
    max_sampling_rounds: int = 4  # with dynamic sampling: rounds of prompts_per_step prompts a step may sample to
                                  # fill its batch with kept groups (it trains on what it has after the last)
    sync_bucket_mb: float = 256   # weight sync moves full tensors in buckets of at most this many MB
    sync_transport: str = "auto"  # auto | shm | collectives: how ranks exchange shards during a sync (auto: shared
                                  # memory between CPU ranks on one host, torch.distributed broadcasts otherwise)
    world_size: int = 1           # trainer.mode=async: rollout-only processes, one engine replica each
    max_staleness: int = 1        # trainer.mode=async: a sample trains at most this many weight versions after the
                                  # weights that started it (0 = on-policy, the colocated run's samples); enforced by
                                  # admitting a generation only while accepted + running <= (S + version + 1) x batch
    sync_every: int = 1           # trainer.mode=async: push the trainer's weights to the rollout workers every N steps
                                  # (samples then run up to N - 1 versions behind: max_staleness >= N - 1)
    request_timeout: float = 0    # trainer.mode=async: seconds a group's episodes may run; past it their requests are
                                  # aborted and the group is dropped, counted in async/groups_timed_out (0 = no limit)
    partial: bool = False         # trainer.mode=async: a weight push aborts the requests in flight and resumes them
                                  # with the new weights from their tokens so far (false: the push waits for them)
    replace_dead: bool = True     # trainer.mode=async: a rollout worker that dies is replaced (its requests go to
                                  # the others at once; the new one serves after it gets the weights); false: the
                                  # run goes on with those left, and stops when none is
    lora: str = "merged"          # with actor.lora: what a weight sync sends the engine. merged: every weight, the
                                  # adapted ones as W + B A * scale (any engine); adapters: only the adapters' factors
                                  # (r wide, PEFT's layout), the engine serving the base weights it started from with
                                  # LoRA on (a backend that can: vllm)
    limit_images: int = 1         # a vision-language model: the most images one prompt may hold (the engine sizes
                                  # its encoder's memory for them; vLLM's limit_mm_per_prompt)


@dataclass
class TaskConfig:
    name: str = "addition"        # a registered task
    reward: str = ""              # a registered reward for every row; empty = the task's default (the dataset
                                  # task's: the reward registered for each row's data_source)
    rewards: Dict[str, float] = field(default_factory=dict)   # several rewards with weights, e.g. {exact_match: 1.0,
                                  # format: 0.1}: the reward is the weighted sum, each component logged; replaces reward
    reward_fn: str = ""           # a reward from a file, path/to/file.py:function (batched or verl's compute_score);
                                  # registered under the function's name and the reward unless reward(s) is set
    source_rewards: Dict[str, str] = field(default_factory=dict)   # data_source -> reward for rows of that source,
                                  # e.g. {openai/gsm8k: gsm8k, my_set: math}; other rows as above
    strict_rewards: bool = False  # a reward function that raises stops the run (default: the sample is marked
                                  # failed, counted in reward/failed, left out of the loss)
    options: Dict[str, Any] = field(default_factory=dict)   # task-specific, validated by the task


@dataclass
class TrainerConfig:
    steps: int = 100              # RL steps
    world_size: int = 1           # worker processes (1 = in this process; more = Ray actors)
    mode: str = "colocated"       # colocated: the engine shares the trainer's processes and generates while they
                                  # wait; async: rollout.world_size processes of their own generate while training runs
    ray_address: str = ""         # join this Ray cluster (e.g. 127.0.0.1:6379); empty = start an embedded one
    placement: str = "pack"       # pack: fill one node first; spread: one worker per node in turn
    devices_per_node: int = 8     # GPUs per node (on CPU: processes); used to size per-node host memory
    prompts_per_step: int = 16
    eval_every: int = 0           # held-out evaluation every N steps (0 = only before and after)
    eval_n: int = 1               # responses per held-out prompt: mean@n and pass@n, overall and per data_source
    eval_temperature: float = 0.0  # 0 = greedy (then eval_n must be 1); > 0 = sampled
    check_logprobs_every: int = 0  # debug: after a weight sync, compare engine and actor logprobs every N steps
    logprob_tolerance: float = 1e-3
    loggers: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    save_every: int = 0           # write a checkpoint every N steps into <run dir>/checkpoints (0 = never)
    keep_checkpoints: int = 2     # the newest N are kept
    checkpoint_async: bool = True  # write a checkpoint's tensors in forked processes while training goes on (it
                                  # becomes visible, renamed from .partial-*, at the next step boundary after the
                                  # writes end); false: training waits for the write
    resume: str = ""              # auto: continue from the run dir's newest complete checkpoint, if any; latest: it
                                  # must exist; or a checkpoint directory. `rlcore run --resume <run dir>` sets it
    max_restarts: int = 0         # a worker that dies (trainer, critic, reward model; a rollout worker that is not
                                  # replaced) restarts the job from the run's newest complete checkpoint (from the
                                  # start without one), up to N times; each restart and why is logged
    stop_grace_s: float = 120     # SIGTERM (what SLURM and Kubernetes send first): the run saves a checkpoint after
                                  # its current step and exits (status 143); past this many seconds it exits without
                                  # one (set it below the scheduler's own grace period)
    resume_strict: bool = True    # refuse a checkpoint of another model family, architecture or plugin set
    export_hf: bool = True        # write the trained actor as an HF checkpoint to <run dir>/hf at the end
    export_max_shard_gb: float = 5.0   # its safetensors files hold at most this many GB (10^9 bytes) each, with an
                                  # index when there are several (HF's sharded layout; transformers writes 5 GB)
    profile_steps: List[int] = field(default_factory=list)   # e.g. [2, 5]: a torch profiler trace and a memory
                                  # record per phase (rollout, sync, logprobs, train...) on every worker rank in
                                  # <run dir>/profile/step<N>/<phase>-rank<r>.json; no profiler on other steps


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    reward_training: RewardTrainingConfig = field(default_factory=RewardTrainingConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: Dict[str, Any] = field(default_factory=dict)  # the options of rollout.agent, bound to its own dataclass
    task: TaskConfig = field(default_factory=TaskConfig)
    algorithm: Dict[str, Any] = field(default_factory=lambda: {"name": "grpo"})  # name + the algorithm's options
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

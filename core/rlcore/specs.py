"""The typed things plugins register. Plugins construct these; the core only reads them."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch

from rlcore.model_spec import ModelSpec, VisionSpec  # noqa: F401  (registered like the rest: plugins import them here)

if TYPE_CHECKING:
    import argparse

    from rlcore.trajectory import Trajectory


@dataclass(frozen=True)
class Algorithm:
    """An RL algorithm: what the controller's generic loop asks of it.

    config_cls: dataclass of its options (validated from the ``algorithm`` config section).
    advantages(batch, cfg) -> (advantages [N,S], metrics). The batch holds rewards [N], group_ids [N] and
        response_mask [N,S]; also old_logprobs, ref_logprobs and values [N,S] when the algorithm asks for them
        below. An algorithm with a critic also stores the critic's targets in it as batch["returns"] [N,S].
    policy_loss(logp, old_logp, advantages, mask, ref_logp|None, cfg) -> (per-token loss [N,S], metrics)
    loss_agg_mode(cfg) -> one of rlcore.losses.AGG_MODES (the critic's loss is aggregated the same way)
    needs_reference(cfg) -> whether reference-policy logprobs are required
    needs_old_logprobs(cfg) -> whether ``advantages`` needs the actor's logprobs before the update (they are
        computed anyway when several updates share a batch)
    needs_critic(cfg) -> whether a value model is trained alongside the actor (then ``value_loss`` is required)
    value_loss(values, old_values, returns, mask, cfg) -> (per-token loss [N,S], metrics)
    keep_group(rewards of one prompt's samples [n], cfg) -> False drops the group and samples other prompts in its
        place (dynamic sampling; counted in the metrics). The default keeps every group.
    state(cfg) -> JSON-able state the algorithm keeps across steps (an adaptive KL coefficient), saved with
        checkpoints; load_state(cfg, state) restores it on resume. The defaults keep none.
    """
    name: str
    config_cls: type
    advantages: Callable[..., tuple[torch.Tensor, dict]]
    policy_loss: Callable[..., tuple[torch.Tensor, dict]]
    loss_agg_mode: Callable[[Any], str]
    needs_reference: Callable[[Any], bool] = lambda cfg: False
    needs_old_logprobs: Callable[[Any], bool] = lambda cfg: False
    needs_critic: Callable[[Any], bool] = lambda cfg: False
    value_loss: Callable[..., tuple[torch.Tensor, dict]] | None = None
    keep_group: Callable[[torch.Tensor, Any], bool] = lambda rewards, cfg: True
    state: Callable[[Any], dict] = lambda cfg: {}
    load_state: Callable[[Any, dict], None] = lambda cfg, state: None


@dataclass(frozen=True)
class Sampling:
    """How one request samples. ``temperature`` 0 is greedy; ``top_k`` -1 and ``top_p`` 1 are off;
    ``stop_token_ids``: tokens that end the response besides eos (kept in it, as eos is); ``min_tokens``: eos and the
    stop ids are not sampled before the response holds this many tokens (vLLM's ``min_tokens``, SGLang's
    ``min_new_tokens``); ``banned_token_ids``: never sampled (a vision-language model's image placeholders: one
    sampled would break the next forward's image count)."""
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    banned_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    """One request's response: its tokens, the sampling policy's logprob of each (after temperature),
    ``finish_reason`` ("stop": eos or a stop id, kept as the last token; "length": max_tokens; "abort": aborted,
    with the tokens sampled until then) and ``versions``: the weight versions that sampled its first and its last
    token (equal unless a weight push came while it was in flight). ``routed_experts``: only from an engine started
    with ``routed_experts=True``, the experts its MoE layers chose per token fed (``rlcore.routed_experts``)."""
    request_id: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: tuple[int, int] = (0, 0)
    routed_experts: torch.Tensor | None = None


class RolloutBackend(abc.ABC):
    """A generation engine, asked one request at a time: batching concurrent requests is the engine's business.

    ``version`` is the weights version the engine holds (0 until the first ``update_weights``); every completion
    reports the versions that sampled it. Capabilities differ between builds (vLLM's CPU build cannot release
    memory); the caller asks ``can_release_memory`` before calling ``release_memory`` / ``resume_memory``.
    """
    can_release_memory: bool = False
    version: int = 0

    @abc.abstractmethod
    async def generate(self, tokens: list[int], sampling: Sampling, seed: int | None, request_id: str) -> Completion:
        """One response to ``tokens``. With a ``seed`` the response depends only on the seed, the weights and
        ``sampling``, not on the other requests in flight (so a resumed run, or another split of prompts over engine
        replicas, samples the same). ``request_id`` is unique among the requests in flight."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """End an in-flight request: its ``generate`` returns what it sampled so far, finish reason "abort".
        An unknown or finished request is no error."""

    @abc.abstractmethod
    def score(self, sequences: Sequence[list[int]], start: Sequence[int]) -> list[list[float]]:
        """Logprob of each token ``sequences[i][j]`` for ``j >= start[i]``, teacher-forced (for correctness checks)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load a stream of full HF-named tensors into the running engine, replacing its weights; they are
        weights ``version`` from now on."""

    async def generate_with_images(self, tokens: list[int], images: Sequence[Any], sampling: Sampling,
                                   seed: int | None, request_id: str) -> Completion:
        """``generate`` for a prompt holding images (a vision-language model): ``tokens`` as the trained model reads
        them (each image's run of placeholder tokens, as many as its embeddings), ``images`` the images (PIL) in
        order; the engine makes its own pixels from them with the checkpoint's processor."""
        raise NotImplementedError(f"{type(self).__name__} cannot take images with its prompts")

    def score_with_images(self, sequences: Sequence[list[int]], start: Sequence[int],
                          images: Sequence[Sequence[Any]]) -> list[list[float]]:
        """``score`` for sequences holding images (``generate_with_images``'s form), each with its own."""
        raise NotImplementedError(f"{type(self).__name__} cannot take images with its prompts")

    def load_adapters(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> None:
        """Serve the base weights with these LoRA adapters from now on (``rollout.lora=adapters``), as weights
        ``version``: ``tensors`` keyed and shaped as PEFT's ``adapter_model.safetensors``, ``config`` its
        ``adapter_config.json``. The adapters of the version before are let go (the engine's memory stays flat).
        Only a backend registered with ``lora_adapters=True`` is asked, and started with ``lora_rank=``."""
        raise NotImplementedError(f"{type(self).__name__} cannot load LoRA adapters")

    def release_memory(self) -> None:
        """Free weights and KV cache while training runs (only when ``can_release_memory``)."""

    def resume_memory(self, what: str) -> None:
        """Re-allocate ``"weights"`` (before a weight push) or ``"kv_cache"`` (before generating)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Shut the engine down cleanly."""


class Agent(abc.ABC):
    """How one episode uses the engine: one response to the prompt (``single_turn``, built in), or turns with tool
    calls and environment observations between them. It runs where the engine is, one coroutine per episode, many
    in flight; the driver scores the trajectories it returns."""

    @abc.abstractmethod
    async def run(self, prompt: list[int], metadata: dict, engine: RolloutBackend, sampling: Sampling,
                  seed: int | None, request_id: str) -> "Trajectory | list[Trajectory]":
        """One episode from ``prompt`` (its task row's ``metadata`` at hand), every request to ``engine`` with
        ``sampling``; ``seed`` and ``request_id`` are this episode's (an agent making several requests derives
        their ids from ``request_id``). The trajectory's ``version`` spans the versions its completions report.
        An episode that cannot be one token sequence (a chat template that does not extend exactly) is several
        trajectories, in order: each trains in the episode's group with the episode's reward."""


@dataclass(frozen=True)
class AgentSpec:
    """build(model_path, cfg, registry[, agent_cfg=]) -> Agent (``model_path`` holds the tokenizer and chat template an
    agent may need; ``cfg`` is the run's config, ``registry`` what the plugins registered, e.g. its environments).
    config_cls: the dataclass of the run's ``agent:`` section for this agent, bound as ``algorithm:`` is to the
        algorithm's (a bad key or value: one ConfigError naming it); then ``build`` gets it as ``agent_cfg=`` (the
        workers call ``make``, which passes it only then).
    check(agent_cfg, registry), if given, raises for what the section names that is not registered (an environment,
        a parser); it runs before any worker or engine starts, and on ``--dry-run``.
    metrics(trajectories) -> the step's metrics of this agent's episodes, logged with the step's (none if None)."""
    name: str
    build: Callable[..., Agent]
    config_cls: type | None = None
    check: Callable[[Any, Any], None] | None = None
    metrics: Callable[[Sequence["Trajectory"]], dict[str, float]] | None = None

    def make(self, model_path: str, cfg: Any, registry: Any, agent_cfg: Any = None) -> Agent:
        """``build``, given ``agent_cfg`` (the bound ``agent:`` section) when the agent declares a config_cls."""
        if self.config_cls is None:
            return self.build(model_path, cfg, registry)
        return self.build(model_path, cfg, registry, agent_cfg=agent_cfg)


@dataclass(frozen=True)
class RolloutBackendSpec:
    """factory(model_path, rollout_config, seed=, max_model_len=, distributed=[, load_weights=]) -> RolloutBackend.
    ``distributed``: the engine spans the trainer's torch.distributed world (tensor-parallel groups of rollout.tp
    consecutive ranks, one replica per group), every rank calling each method with its replica's inputs.
    ``load_weights=False`` (passed only when needed, so a backend without the keyword still serves plain
    checkpoints): ``model_path`` holds a config and tokenizer but no weights, because the checkpoint's files are not
    the model the actor trains (block FP8, dequantized by rlcore as it loads); start with placeholder weights, the
    first weight push brings the real ones.
    check(hf_config, rollout_config, here), if given, raises ConfigError for a model or settings this engine cannot
    serve (one line: what, and what to do instead); it runs before any worker starts, and on ``--dry-run`` with
    ``here=False`` (a dry run plans for other machines: leave out the limits of this one, e.g. of a CPU build).
    ``lora_adapters``: the engine serves LoRA adapters on its base weights (``RolloutBackend.load_adapters``), so
    ``rollout.lora=adapters`` may use it; the factory then gets ``lora_rank=`` (the adapters' rank, to size them).
    ``images``: the engine takes images with its prompts (``RolloutBackend.generate_with_images``): a
    vision-language model's runs may use it.
    ``routed_experts``: the device types ("cpu", "cuda") on which the engine returns the experts its MoE layers
    routed each token to (``Completion.routed_experts``), so ``actor.moe.routing_replay=rollout`` may use it; the
    factory then gets ``routed_experts=True``. Empty: none (the option is refused, naming the backend)."""
    name: str
    factory: Callable[..., RolloutBackend]
    check: Callable[[dict, Any, bool], None] | None = None
    lora_adapters: bool = False
    images: bool = False
    routed_experts: tuple[str, ...] = ()


@dataclass(frozen=True)
class OptimizerSpec:
    """build(model_chunks, optim_config) -> a megatron optimizer. check(optim_config, section), if given, raises
    ConfigError for settings this optimizer does not take (``section``: where they are, e.g. ``actor.optim``); it
    runs before any worker starts, and on ``--dry-run``."""
    name: str
    build: Callable[..., Any]
    check: Callable[[Any, str], None] | None = None


@dataclass(frozen=True)
class RewardSpec:
    """fn(responses: list[str], metadata: list[dict]) -> list[float] | dict[str, list[float]]

    data_sources: the ``data_source`` values (verl's dataset names, e.g. ``openai/gsm8k``) this reward scores by
    default when a task's rows are scored by their source.
    sequences: fn takes a third argument, each episode's whole token sequence (prompt and response, the policy's
    tokens): what a reward model reads.
    """
    name: str
    fn: Callable[..., Any]
    data_sources: tuple[str, ...] = ()
    sequences: bool = False


@dataclass(frozen=True)
class TaskSpec:
    """A prompt source.

    build(options: dict, seed: int) -> Task
    default_reward: name of a registered reward; empty = each row is scored by the reward registered for its data
        source (``Task.data_sources``), as verl does
    """
    name: str
    build: Callable[[dict, int], "Task"]
    default_reward: str
    description: str = ""


class Task(abc.ABC):
    """Prompts for training and evaluation. ``metadata`` is passed to the reward with each response."""

    @abc.abstractmethod
    def train_prompts(self, step: int, count: int) -> list[tuple[str, dict]]:
        """``count`` (prompt text, metadata) pairs for training step ``step`` (deterministic given the seed). A
        larger ``count`` at the same step extends the list: dynamic sampling asks for more prompts this way."""

    @abc.abstractmethod
    def eval_prompts(self) -> list[tuple[str, dict]]:
        """The held-out set, fixed for the run."""

    def data_sources(self) -> dict[str, int]:
        """Rows per ``data_source`` over every prompt the task will give (training and held-out), for rewards that
        dispatch by source; empty when the task's rows carry no source."""
        return {}

    def state_dict(self) -> dict:
        """What resumes the sequence of training prompts exactly (JSON-able); empty for tasks whose prompts depend
        on the step alone."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``'s result."""

    def bind_tokenizer(self, tokenizer) -> None:
        """Called once the model's tokenizer is loaded, before any prompt is asked for: a task that renders
        prompts with the chat template, or filters them by token length, does it here."""

    def longest_prompt(self) -> tuple[int, str] | None:
        """(tokens of the longest prompt the task will hand out, the setting that leaves longer ones out, or ""),
        known once the tokenizer is bound; None for tasks that make prompts as they go. The run checks it with
        ``rollout.max_response_len`` against the model's context before any worker starts."""
        return None

    def supervised_examples(self, step: int, count: int) -> list[tuple[str, str]] | list[tuple[str, str, dict]]:
        """(prompt, completion) pairs for a supervised warm start, or (prompt, completion, metadata) triples whose
        metadata holds the prompt's images (``rlcore.multimodal.IMAGES``); tasks without them raise."""
        raise NotImplementedError(f"task {type(self).__name__} has no supervised examples for a warm start")

    def preference_pairs(self, count: int, held_out: bool) -> list[tuple[str, str, str]]:
        """(prompt, chosen, rejected) pairs for a reward model (``reward_training.synthetic_pairs``), the chosen
        response better than the rejected one; ``held_out``: on the held-out prompts (the reward model's own
        held-out accuracy), else on training prompts. Tasks without them raise."""
        raise NotImplementedError(f"task {type(self).__name__} makes no preference pairs: give "
                                  f"reward_training.train_files instead")

    def write_tokenizer(self, directory: str) -> int:
        """Write an HF tokenizer for built-in tiny models into ``directory``; return its vocabulary size."""
        raise NotImplementedError(f"task {type(self).__name__} has no built-in tokenizer; set model.path")


class Logger(abc.ABC):
    name: str = ""

    def open(self, run_dir: str, config: Any) -> None: ...

    @abc.abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


# --- the command line: what plugins add to `rlcore` -----------------------------------------------------------------

@dataclass(frozen=True)
class CommandSpec:
    """``rlcore <name> ...``: add_arguments(parser) declares its arguments (subcommands of its own too, with
    ``parser.add_subparsers``); run(args) -> the exit status. A ``RlcoreError`` it raises is printed as one line, exit
    2, as the core's commands do. A ``--plugins`` among its arguments selects the plugins it is loaded with."""
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class DialectSpec:
    """``rlcore run --<flag>``: the run's ``key=value`` arguments may be another framework's keys too.
    translate(overrides, registry) -> (rlcore overrides, translation): its keys translated (one it cannot translate
    raises ConfigError, one line), rlcore's own passed on; describe(translation) -> the text printed once before the
    run starts; save(translation, run_dir) keeps the translation beside the run's config."""
    flag: str
    help: str
    translate: Callable[[Sequence[str], Any], tuple[list[str], Any]]
    describe: Callable[[Any], str]
    save: Callable[[Any, str], None]

    @property
    def name(self) -> str:
        """The registry's key: the flag without its dashes."""
        return self.flag

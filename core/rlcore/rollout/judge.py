"""A generative judge as one of the run's rewards (``reward_model.kind=generative``): a causal LM reads a rubric
rendered for each episode (``reward_model.judge.template``, with the episode's prompt, its response and the row's
answer filled in) and writes a verdict, in which ``reward_model.judge.parser`` (a regex with one group) finds the
score. A verdict without it fails that episode alone, counted in ``reward/failed`` with the answer the judge gave
(the reward returns the exception in place of the value: ``rlcore.rewards``), never scored 0.

The judge runs on a rollout engine of its own (``rlcore.workers.judge``: ``reward_model.world_size`` processes, one
engine each, built by the judge's backend's factory, weights fixed: nothing is ever pushed to it), asked through the
per-request contract (``RolloutBackend.generate``), every episode's request in flight at once. Its own processes,
not the policy's engine: so the policy's engine (and its engine check) is untouched, in both modes, and in async mode
the judge scores on the driver's side while the rollout workers go on generating. A judge served by the policy's own
engines (a second model on the same workers) is not done here.

``{prompt}`` is the prompt as the policy saw it: the episode's prompt tokens decoded by the policy's tokenizer (its
special tokens left out, as the response's are), so a chat task's prompt comes with its template's role words.
"""
from __future__ import annotations

import logging
import math
import os
import re
import zlib
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from rlcore.config.judge import compile_parser, load_template
from rlcore.errors import ConfigError, RlcoreError
from rlcore.rewards import RewardBroken
from rlcore.specs import Completion, RewardSpec, Sampling

if TYPE_CHECKING:
    from rlcore.config import Config

log = logging.getLogger(__name__)
SHOW_UNPARSABLE = 3          # unparsable answers the log shows (their count is in reward/failed)
PLACEHOLDERS = re.compile(r"\{(prompt|response|answer)\}")


class JudgeError(ValueError):
    """One episode the judge could not score (the others are scored): counted in reward/failed with this reason. Its
    message is the same for every episode that fails alike (the metrics and the log count reasons; the log names each
    new one once), what differs per episode kept beside it."""


class JudgeUnparsable(JudgeError):
    """The judge's answer has no score the parser can read (``answer``: what it wrote)."""

    def __init__(self, message: str, answer: str = ""):
        super().__init__(message)
        self.answer = answer


class JudgeTooLong(JudgeError):
    """The rendered rubric and the judge's answer do not fit the judge's context."""


class JudgeMissing(JudgeError):
    """The template reads something this episode does not have (a row without an answer)."""


class JudgeDied(RewardBroken):
    """The judge's engine failed or died: no episode can be scored (fatal, whatever task.strict_rewards says)."""


class JudgeEngines(Protocol):
    """The judge's engines (``rlcore.workers.judge.JudgeWorkers``): one completion per prompt, in order."""

    def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int]) -> list[Completion]: ...


# --- the rubric and the parser (pure) --------------------------------------------------------------------------------
def render(template: str, prompt: str | None, response: str, metadata: dict) -> str:
    """The rubric for one episode: ``{prompt}``, ``{response}`` and ``{answer}`` (``metadata["answer"]``) filled in,
    in one pass (a response that contains "{answer}" stays as it is); other braces are the template's own text."""
    def value(match: re.Match) -> str:
        key = match[1]
        if key == "response":
            return response
        if key == "prompt":
            assert prompt is not None, "render: the template reads {prompt}; pass it"
            return prompt
        if metadata.get("answer") is None:
            raise JudgeMissing(f"the template reads {{answer}}, and this row's metadata has none (keys: "
                               f"{', '.join(sorted(metadata)) or 'none'})")
        return str(metadata["answer"])
    return PLACEHOLDERS.sub(value, template)


def parse(parser: re.Pattern, answer: str) -> float:
    """The score in the judge's ``answer``: the parser's group at its first match."""
    found = parser.search(answer)
    try:
        score = float(found[1]) if found is not None and found[1] is not None else None
    except ValueError:
        score = None
    if score is None or not math.isfinite(score):
        what = "a match whose group is no number" if found is not None else "no match"
        raise JudgeUnparsable(f"{what} of {parser.pattern!r} in the judge's answer", answer)
    return score


def prompt_text(tokenizer, sequence: Sequence[int], response: str) -> str:
    """The prompt of an episode whose token sequence (prompt, then response) is ``sequence`` and whose response reads
    ``response``: the sequence's text less the response's. Decoding is per token for the tokenizers rlcore runs
    (byte-level BPE, the tiny tasks' characters), so the text ends with the response; where it does not (a character
    split over the boundary), the shortest tail of tokens that reads as the response is cut off instead."""
    text = tokenizer.decode(list(sequence), skip_special_tokens=True)
    if text.endswith(response):
        return text[:len(text) - len(response)]
    for start in range(len(sequence) - 1, -1, -1):
        if tokenizer.decode(list(sequence[start:]), skip_special_tokens=True) == response:
            return tokenizer.decode(list(sequence[:start]), skip_special_tokens=True)
    raise JudgeMissing(f"no end of the episode's tokens reads as its response {response[:60]!r}: its prompt cannot be "
                       f"told apart")


def request_seed(run_seed: int, tokens: Sequence[int]) -> int:
    """A judge request's seed: fixed by the run's seed and what the judge reads (a resumed run judges alike)."""
    return zlib.crc32(f"{run_seed}:{','.join(map(str, tokens))}".encode()) & 0x7FFFFFFF


# --- the reward ------------------------------------------------------------------------------------------------------
class GenerativeJudge:
    """The judge's scores, one per episode (or, for an episode it cannot score, why): its checkpoint, tokenizer and
    backend checked by ``use`` before any worker starts, its engines handed over by ``start``."""

    def __init__(self, name: str, template: str, parser: str, max_tokens: int, temperature: float, chat: bool,
                 seed: int = 0):
        self.name, self.path = name, ""
        self.template, self.parser = load_template(template), compile_parser(parser)
        self.sampling = Sampling(max_tokens, temperature)
        self.chat, self.seed = chat, seed
        self.reads_prompt = "{prompt}" in self.template
        self.tokenizer: Any = None          # the judge's
        self.context = 0
        self.engines: JudgeEngines | None = None
        self.policy_tokenizer: Any = None
        self.unparsable_shown = 0

    def use(self, path: str, backend, rollout_cfg) -> None:
        """Judge with the causal LM in ``path`` on ``backend`` (a ``RolloutBackendSpec``) at ``rollout_cfg``; one
        rlcore or the backend cannot serve is refused, in one line naming it."""
        from transformers import AutoTokenizer

        from rlcore.converted import starts_weightless
        from rlcore.megatron.model import read_hf_config

        hf_config = read_hf_config(path)
        heads = [a for a in hf_config.get("architectures") or [] if not a.endswith(("ForCausalLM", "LMHeadModel"))]
        if heads:
            raise ConfigError(f"reward_model.path {path} is a {heads[0]}, not a causal LM: a generative judge writes "
                              f"its verdict (reward_model.kind=scalar scores with a sequence classifier)")
        if starts_weightless(path, hf_config):
            raise ConfigError(f"reward_model.path {path}: the judge's engine loads its weights from the checkpoint's "
                              f"files, which are not the model here (a converted or block-FP8 checkpoint): give the "
                              f"judge as a Hugging Face checkpoint of plain weights")
        if backend.check:
            backend.check(hf_config, rollout_cfg, True)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"reward_model.path {path} has no tokenizer transformers can load ({e}): save the "
                              f"judge's tokenizer into it (tokenizer.save_pretrained)") from None
        if self.chat and not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"reward_model.judge.chat = true, and reward_model.path {path}'s tokenizer has no chat "
                              f"template: set reward_model.judge.chat=false (the rubric as plain text)")
        self.path, self.context = path, int(hf_config["max_position_embeddings"])

    def spec(self) -> RewardSpec:
        return RewardSpec(self.name, self, sequences=True)

    def start(self, engines: JudgeEngines, policy_tokenizer) -> None:
        self.engines, self.policy_tokenizer = engines, policy_tokenizer

    def encode(self, rubric: str) -> list[int]:
        """The judge's tokens for a rubric: plain text, or one user message through its chat template."""
        if self.chat:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": rubric}], tokenize=True,
                                                           add_generation_prompt=True, return_dict=False))
        return self.tokenizer.encode(rubric, add_special_tokens=False)

    def requests(self, responses: list[str], metadata: list[dict], sequences: list[list[int]]
                 ) -> list[list[int] | JudgeError]:
        """Each episode's request to the judge (its tokens), or why it has none."""
        out: list[list[int] | JudgeError] = []
        for response, meta, sequence in zip(responses, metadata, sequences):
            try:
                prompt = prompt_text(self.policy_tokenizer, sequence, response) if self.reads_prompt else None
                tokens = self.encode(render(self.template, prompt, response, meta))
                if not tokens:
                    raise JudgeMissing("the rendered rubric is empty")
                if len(tokens) + self.sampling.max_tokens > self.context:
                    raise JudgeTooLong(f"the rubric and reward_model.judge.max_tokens = {self.sampling.max_tokens} "
                                       f"exceed the judge's context, {self.context} tokens (max_position_embeddings "
                                       f"of {self.path})")
                out.append(tokens)
            except JudgeError as e:
                out.append(e)
        return out

    def __call__(self, responses: list[str], metadata: list[dict], sequences: list[list[int]]
                 ) -> list[float | Exception]:
        """Each episode's score, or the reason it has none (returned, not raised: the others keep theirs)."""
        if self.engines is None:
            raise RlcoreError(f"reward {self.name!r} is a generative judge whose engines have not started")
        results: list[float | Exception] = []
        asked: list[tuple[int, list[int]]] = []       # (episode, its request)
        for i, request in enumerate(self.requests(responses, metadata, sequences)):
            results.append(request if isinstance(request, JudgeError) else math.nan)
            if not isinstance(request, JudgeError):
                asked.append((i, request))
        prompts = [tokens for _, tokens in asked]
        completions = self.engines.generate(prompts, self.sampling, [request_seed(self.seed, p) for p in prompts])
        if len(completions) != len(prompts):
            raise JudgeDied(f"the judge's engines answered {len(completions)} of {len(prompts)} requests")
        for (i, _), completion in zip(asked, completions):
            try:
                results[i] = parse(self.parser, self.tokenizer.decode(completion.tokens, skip_special_tokens=True))
            except JudgeUnparsable as e:
                results[i] = e
                if self.unparsable_shown < SHOW_UNPARSABLE:
                    self.unparsable_shown += 1
                    log.warning("reward %r: the judge's answer %r has no score that reward_model.judge.parser %r "
                                "reads (counted in reward/failed; the first %d such answers are shown)", self.name,
                                e.answer[:300], self.parser.pattern, SHOW_UNPARSABLE)
        return results


def judge_rollout_config(cfg: Config):
    """The rollout settings the judge's engine starts with: the run's, with the judge's backend and KV cache, one
    process per engine (tp 1), no adapters."""
    import dataclasses

    judge = cfg.reward_model.judge
    return dataclasses.replace(cfg.rollout, backend=judge.backend or cfg.rollout.backend, tp=1, lora="merged",
                               kv_cache_gib=judge.kv_cache_gib or cfg.rollout.kv_cache_gib)


def judge_engines(cfg: Config) -> int:
    """The judge's engines (processes): reward_model.world_size, 0 = one."""
    return cfg.reward_model.world_size or 1


def load_judge(cfg: Config, registry) -> GenerativeJudge:
    """The run's judge, registered as the reward ``reward_model.name``, checked here, before any worker starts."""
    rm = cfg.reward_model
    judge_cfg = judge_rollout_config(cfg)
    backend = registry.get("rollout_backends", judge_cfg.backend)
    judge = GenerativeJudge(rm.name, rm.judge.template, rm.judge.parser, rm.judge.max_tokens, rm.judge.temperature,
                            rm.judge.chat, cfg.run.seed)
    judge.use(os.path.expanduser(rm.path), backend, judge_cfg)
    registry.add("rewards", judge.spec(), owner=f"reward_model.path={rm.path} (generative judge)")
    return judge

"""The tools agent in runs as users start them (issue 27): `rlcore run ... tool-calculator` on real vLLM or SGLang,
real megatron-core and real Ray. The preset learns and logs its agent metrics; killed after its first checkpoint and
resumed, it logs what the uninterrupted run logged; a tool that crashes and one that runs past its timeout are
counted error observations under PPO; a verl multi-turn Parquet file with verl's tool config runs through the loop
on SGLang. Every run starts from the preset's warm start, built once (``tool_warm_start_cache``)."""
import importlib.util
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runs import ENV, EVERY, STEPS, install_distribution, kill_when, logged, rlcore_run, run_to_end, without_timings

PRESET = "tool-calculator"
ENGINE_BOUND = 1e-3           # trainer.logprob_tolerance's default: the engine scores as the actor after a push
AGENT_KEYS = ("agent/turns_mean", "agent/turns_max", "agent/tool_calls_mean", "agent/tool_errors",
              "agent/tool_timeouts", "agent/tool_seconds", "agent/observation_tokens_mean",
              "agent/truncated_results", "agent/cut_by_budget", "agent/split_samples")


def tool_run(run_dir, cache, *extra, plugins="qwen3,grpo,vllm,tools"):
    """The tool-calculator preset for STEPS steps, checkpoints every EVERY, evaluated every 4 (``extra``:
    overrides), or ``--resume`` of ``run_dir``."""
    return rlcore_run(run_dir, cache, *extra, preset=PRESET, plugins=plugins)


def short(run_dir, cache, *extra, plugins):
    """Two steps, no checkpoint, no evaluation and no export: the engine checked after each push."""
    return tool_run(run_dir, cache, "trainer.steps=2", "trainer.save_every=0", "trainer.eval_every=0",
                    "trainer.export_hf=false", "trainer.check_logprobs_every=1", *extra, plugins=plugins)


def with_plugins_on_path(site):
    """The run's environment with ``site`` on PYTHONPATH, so that its Ray workers import from it too."""
    return {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}


def assert_agent_metrics_logged(history):
    for h in history:
        missing = [k for k in AGENT_KEYS if k not in h]
        assert not missing, f"step {h['step']} lacks {missing}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tool_warm_start_cache):
    """The preset run for STEPS steps without interruption, engine checked at every evaluation: its run directory."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    run_to_end(tool_run(run_dir, tool_warm_start_cache, "trainer.check_logprobs_every=4"))
    return run_dir


@pytest.mark.slow
@pytest.mark.e2e
def test_the_tool_preset_learns_to_call_its_tool_and_logs_what_the_agent_did(uninterrupted):
    summary = json.loads((uninterrupted / "summary.json").read_text())
    history = logged(uninterrupted)
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))
    assert summary["eval_accuracy_after"] >= summary["eval_accuracy_before"] + 0.15, summary
    assert [h["step"] for h in history if "eval/accuracy" in h] == [4, 8]
    assert_agent_metrics_logged(history)
    assert history[-1]["agent/tool_calls_mean"] > history[0]["agent/tool_calls_mean"]     # it learns to call
    assert all(h["check/logprob_max_diff"] < ENGINE_BOUND for h in history if h["step"] % 4 == 0)
    assert (uninterrupted / "reward_curve.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.e2e
def test_killed_after_its_first_checkpoint_and_resumed_it_logs_what_the_uninterrupted_run_logged(
        tmp_path, tool_warm_start_cache, uninterrupted):
    """Environment state lives in the episode, so a checkpoint holds none: the resumed run replays the same episodes
    from the same seeds. Every metric but the wall-clock ones (runs.WALL_CLOCK) must agree, agent/* included."""
    kill_at = random.randint(EVERY + 1, STEPS - 1)
    run_dir = tmp_path / "run"
    first = run_dir / "checkpoints" / f"step_{EVERY:08d}"     # written while step 5 runs: complete after it
    kill_when(tool_run(run_dir, tool_warm_start_cache, "trainer.check_logprobs_every=4"),
              lambda: len(logged(run_dir)) >= kill_at and first.exists())
    resumed = run_to_end(tool_run(run_dir, tool_warm_start_cache, "--resume"))
    assert f"resuming from {run_dir}/checkpoints/step_0000000" in resumed.stderr
    assert without_timings(logged(run_dir)) == without_timings(logged(uninterrupted)), f"killed after step {kill_at}"


# A calculator whose multiply fails by its first factor: an exception for one third of them, a sleep far past
# agent.tool_timeout_s for another, the product for the rest. At the warm start about 11% of episodes call the tool
# (some 10-30 calls a step), so both failures come up in two steps.
FLAKY_CALCULATOR = '''"""The calculator, flaky: multiply raises or straggles, by its first factor."""
import time

from rlcore.hookspecs import hookimpl
from rlcore_agent_tools.specs import EnvironmentSpec


class FlakyCalculator:
    def reset(self, **row):
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        if a % 3 == 0:
            raise ArithmeticError(f"no multiples of 3 today ({a})")
        if a % 3 == 1:
            time.sleep(3)
        return a * b


@hookimpl
def rlcore_environments():
    return [EnvironmentSpec("flaky_calculator", lambda options: FlakyCalculator())]
'''


@pytest.mark.slow
@pytest.mark.e2e
def test_crashing_and_straggling_tools_are_counted_error_observations_under_ppo(tmp_path, tool_warm_start_cache):
    """Two PPO steps (the critic over the whole multi-turn sample) with the flaky calculator: the steps complete,
    both failures are counted for the tool by name, and the engine still scores as the actor."""
    site = tmp_path / "site"
    site.mkdir()
    install_distribution(site, "rlcore-flaky-calculator", "flaky_calculator", FLAKY_CALCULATOR,
                         entry="flaky_calculator")
    run_dir = tmp_path / "run"
    run_to_end(short(run_dir, tool_warm_start_cache, "algorithm.name=ppo", "agent.environment=flaky_calculator",
                     "agent.tool_timeout_s=0.5", plugins="qwen3,grpo,ppo,vllm,tools,flaky_calculator"),
               env=with_plugins_on_path(site))
    history = logged(run_dir)
    assert [h["step"] for h in history] == [1, 2]
    assert_agent_metrics_logged(history)
    assert sum(h.get("agent/tool_timeouts/multiply", 0) for h in history) > 0, history
    assert sum(h.get("agent/tool_errors/multiply", 0) for h in history) > 0, history
    assert all("critic/value_loss" in h for h in history)
    assert all(h["check/logprob_max_diff"] < ENGINE_BOUND for h in history)


# A verl tool as a user's package defines one (verl's BaseTool methods, all coroutines; verl itself is not installed
# here): multiply, which records what create was given for the episode and each call, for the test to read.
VERL_MULTIPLY = '''"""multiply as a verl native tool; it appends what it sees to config['log'] (JSON lines)."""
import json


class Response:
    def __init__(self, text):
        self.text, self.image, self.video = text, None, None


class Multiply:
    def __init__(self, config, tool_schema):
        self.log, self.instances = config["log"], {}

    def _note(self, **what):
        with open(self.log, "a") as f:
            f.write(json.dumps(what) + "\\n")

    async def create(self, instance_id, **kwargs):
        self.instances[instance_id] = kwargs.get("create_kwargs", kwargs)
        self._note(event="create", create_kwargs=self.instances[instance_id])
        return instance_id, Response("")

    async def execute(self, instance_id, parameters, **kwargs):
        self._note(event="execute", parameters=parameters, row=self.instances[instance_id]["row"])
        return Response(str(parameters["a"] * parameters["b"])), 0.0, {}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.0

    async def release(self, instance_id, **kwargs):
        del self.instances[instance_id]
'''

VERL_TOOL_CONFIG = '''tools:
  - class_name: "verl_multiply.Multiply"
    config:
      type: native
      log: {log}
    tool_schema:
      type: "function"
      function:
        name: "multiply"
        description: "Multiply two integers."
        parameters:
          type: "object"
          properties:
            a: {{type: "integer", description: "the first factor"}}
            b: {{type: "integer", description: "the second factor"}}
          required: ["a", "b"]
'''


def verl_multiplication_rows(count, seed=0):
    """verl multi-turn rows of 3-digit products: the prompt as chat messages, the answer as reward_model's ground
    truth, and extra_info.tools_kwargs giving multiply's create_kwargs per row."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randrange(100, 1000), rng.randrange(100, 1000)
        rows.append({"data_source": "verl_multiplication", "prompt": [{"role": "user", "content": f"{a}*{b}"}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                     "extra_info": {"index": i, "need_tools_kwargs": True, "tools_kwargs": {
                         "multiply": {"create_kwargs": {"row": i, "product": a * b}}}}})
    return rows


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed")
def test_a_verl_multi_turn_parquet_file_runs_through_the_tools_agent_on_sglang(tmp_path, tool_warm_start_cache):
    """verl's data and tool config as they are: the dataset task over the Parquet file, the verl_tools environment
    over the YAML, from the preset's warm-started checkpoint; two GRPO steps on SGLang. Each episode's tool was
    created with its own row's create_kwargs, and the policy's calls reached that episode's instance: the warm start
    copies the prompt's factors into its calls, so many calls multiply the factors of the row their instance was
    created for (seen: 29 of 51), where a call that reached another episode's instance would nearly never."""
    site, log = tmp_path / "site", tmp_path / "multiply.jsonl"
    site.mkdir()
    (site / "verl_multiply.py").write_text(VERL_MULTIPLY)
    config = tmp_path / "tool_config.yaml"
    config.write_text(VERL_TOOL_CONFIG.format(log=json.dumps(str(log))))
    rows = verl_multiplication_rows(64)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    [model] = os.listdir(tool_warm_start_cache)
    run_dir = tmp_path / "run"
    run_to_end(short(run_dir, tool_warm_start_cache, f"model.path={tool_warm_start_cache / model}",
                     "task.name=dataset", f"task.options.train_files=[{tmp_path / 'train.parquet'}]",
                     "task.reward=final_answer", "agent.environment=verl_tools",
                     f"agent.options.tool_config_path={config}", "rollout.backend=sglang",
                     plugins="qwen3,grpo,sglang,tools"), env=with_plugins_on_path(site))
    history = logged(run_dir)
    assert [h["step"] for h in history] == [1, 2]
    assert_agent_metrics_logged(history)
    assert all(h["check/logprob_max_diff"] < ENGINE_BOUND for h in history)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    created = [s["create_kwargs"] for s in seen if s["event"] == "create"]
    calls = [s for s in seen if s["event"] == "execute"]
    n = 8                                                  # the preset's rollout.n
    assert len(created) == 2 * 16 * n                      # one episode per sample of the two steps' 16 prompts
    by_row = {r["extra_info"]["index"]: r["extra_info"]["tools_kwargs"]["multiply"]["create_kwargs"] for r in rows}
    assert all(c == by_row[c["row"]] for c in created), created[:3]
    assert len({c["row"] for c in created}) == 2 * 16      # each drawn row's episodes, each with that row's kwargs
    assert calls and sum(h["agent/tool_calls_mean"] for h in history) * 16 * n >= len(calls)
    own_row = [c["parameters"]["a"] * c["parameters"]["b"] == by_row[c["row"]]["product"] for c in calls]
    assert sum(own_row) >= len(calls) / 4, f"{sum(own_row)} of {len(calls)} calls multiply their row's factors"

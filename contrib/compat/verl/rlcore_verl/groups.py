"""The translations that need several verl keys at once (a ratio, a switch and its value, a layout checked against
another), run after every key is read, in the order of ``GROUPS`` (a later group may use what an earlier one set).
Each takes the group's keys and values, every verl key given, the rlcore overrides so far and the architecture ->
family lookup, and returns a Line per key of the group."""
from __future__ import annotations

import math
import os
from typing import Any, Callable

from rlcore_verl.keys import (ARR, IGNORED, REFUSED, RM, RM_OFF, TRANSLATED, Key, Refused, as_bool, as_float,
                              as_int, as_paths, as_str, lookup)
from rlcore_verl.lines import Line, refusal, show

A = f"{ARR}.actor"
Group = Callable[[dict[str, Any], dict[str, Any], dict[str, Any], Any], dict[str, Line]]


def ok(key: str, value: Any, rlcore: dict[str, Any], note: str = "") -> Line:
    return Line(key, value, TRANSLATED, rlcore, note)


def unused(key: str, value: Any, note: str) -> Line:
    return Line(key, value, IGNORED, note=note)


def no(key: str, value: Any, why: str) -> Line:
    return Line(key, value, REFUSED, note=why)


def _checked(fn: Callable[[Any], Any], key: str, value: Any) -> Any:
    try:
        return fn(value)
    except Refused as e:
        raise refusal(key, value, e.why, e.closest) from None


def data(values, given, overrides, families) -> dict[str, Line]:
    out = {}
    for key, option in (("data.train_files", "train_files"), ("data.val_files", "val_files")):
        if key in values:
            out[key] = ok(key, values[key], {"task.name": "dataset",
                                             f"task.options.{option}": _checked(as_paths, key, values[key])})
    return out


def model(values, given, overrides, families) -> dict[str, Line]:
    key = f"{ARR}.model.path"
    path = _checked(as_str, key, values[key])
    local = os.path.join(os.path.expanduser(path), "config.json")
    if os.path.isfile(local):
        target, note = {"model.path": path}, "the checkpoint"
        hf = _read_json(local)
    else:
        name, bundled = bundled_config(path)
        if bundled is None:
            return {key: ok(key, path, {"model.path": path}, "not on this machine: the run will say so")}
        hf = bundled
        target, note = {"model.hf_config": name}, (f"not found here: sizes from the bundled {name} config for "
                                                  f"--dry-run; set model.path to train")
    arch = (hf.get("architectures") or ["?"])[0]
    found = families(arch) if families else []
    named = [f for f in found if f.replace("_", "-") in os.path.basename(path.rstrip("/")).lower()]
    if len(found) == 1 or len(named) == 1:
        target["model.family"] = (named or found)[0]
    elif found:
        note += f"; set model.family ({' or '.join(found)} serve {arch})"
    return {key: ok(key, path, target, note)}


def bundled_config(path: str) -> tuple[str, dict | None]:
    """The bundled config a checkpoint's name points to: 'Qwen/Qwen3-30B-A3B-Base' -> qwen3-30b-a3b,
    '.../DeepSeek-V3-config-verl' -> deepseek-v3 (the longest leading run of '-'-separated parts that names one)."""
    from rlcore.config.schema import Config
    from rlcore.errors import ConfigError
    from rlcore.sizing import read_model_config

    parts = os.path.basename(path.rstrip("/")).lower().split("-")
    for n in range(len(parts), 0, -1):
        cfg = Config()
        cfg.model.hf_config = "-".join(parts[:n])
        try:
            return cfg.model.hf_config, read_model_config(cfg)
        except ConfigError:
            continue
    return "", None


def _read_json(path: str) -> dict:
    import json

    with open(path, encoding="utf-8") as f:
        return json.load(f)


def batch(values, given, overrides, families) -> dict[str, Line]:
    out = {}
    prompts = given.get("data.train_batch_size", 1024)           # verl's default
    if "data.train_batch_size" in values:
        prompts = _checked(as_int, "data.train_batch_size", prompts)
        out["data.train_batch_size"] = ok("data.train_batch_size", prompts, {"trainer.prompts_per_step": prompts})
    for key, section in ((f"{A}.ppo_mini_batch_size", "actor"), ("critic.ppo_mini_batch_size", "critic")):
        if key in values:
            mini = _checked(as_int, key, values[key])
            if mini < 1 or prompts % mini:
                out[key] = no(key, mini, f"data.train_batch_size = {prompts} is not a multiple of it (rlcore "
                                         f"updates {section}.mini_batches times on equal shares of a batch)")
            else:
                out[key] = ok(key, mini, {f"{section}.mini_batches": prompts // mini},
                              f"{prompts} prompts per step / {mini}")
    return out


def world(values, given, overrides, families) -> dict[str, Line]:
    per_node = _checked(as_int, "trainer.n_gpus_per_node", given.get("trainer.n_gpus_per_node", 8))
    nodes = _checked(as_int, "trainer.nnodes", given.get("trainer.nnodes", 1))
    out = {}
    if "trainer.n_gpus_per_node" in values:
        out["trainer.n_gpus_per_node"] = ok("trainer.n_gpus_per_node", per_node, {
            "trainer.devices_per_node": per_node, "trainer.world_size": per_node * nodes})
    if "trainer.nnodes" in values:
        out["trainer.nnodes"] = ok("trainer.nnodes", nodes, {"trainer.devices_per_node": per_node,
                                                             "trainer.world_size": per_node * nodes})
    return out


def steps(values, given, overrides, families) -> dict[str, Line]:
    out = {}
    total = values.get("trainer.total_training_steps")
    if total is not None:
        n = _checked(as_int, "trainer.total_training_steps", total)
        out["trainer.total_training_steps"] = ok("trainer.total_training_steps", n, {"trainer.steps": n})
    if "trainer.total_epochs" in values:
        epochs = _checked(as_int, "trainer.total_epochs", values["trainer.total_epochs"])
        if total is not None:
            out["trainer.total_epochs"] = unused("trainer.total_epochs", epochs, "total_training_steps is given "
                                                 "(verl uses it too)")
        else:
            rows = count_rows(overrides.get("task.options.train_files", []))
            prompts = overrides.get("trainer.prompts_per_step", given.get("data.train_batch_size", 1024))
            if rows is None:
                out["trainer.total_epochs"] = unused("trainer.total_epochs", epochs, "the training files are not on "
                                                     "this machine to count their rows: set trainer.steps")
            else:
                out["trainer.total_epochs"] = ok("trainer.total_epochs", epochs, {
                    "trainer.steps": epochs * (rows // prompts)}, f"{epochs} x ({rows} rows // {prompts} prompts)")
    return out


def count_rows(files: list[str]) -> int | None:
    """Rows in the training files (Parquet metadata, JSON(L) records); None when a file is not readable here."""
    total = 0
    for path in files:
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            return None
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            total += pq.ParquetFile(path).metadata.num_rows
        elif path.endswith(".json"):
            import json

            with open(path, encoding="utf-8") as f:
                total += len(json.load(f))
        else:                                       # JSON lines: one record a line
            with open(path, encoding="utf-8") as f:
                total += sum(1 for line in f if line.strip())
    return total


def warmup(section: str) -> Group:
    """verl steps its LR scheduler once per training step, rlcore once per optimizer update: verl's warm-up of N
    steps is N x mini_batches x epochs updates here."""
    def translate(values, given, overrides, families) -> dict[str, Line]:
        key, ratio_key = f"{_verl(section)}.optim.lr_warmup_steps", f"{_verl(section)}.optim.lr_warmup_steps_ratio"
        out = {}
        n = _checked(as_int, key, values.get(key, -1))
        per_step = overrides.get(f"{section}.mini_batches", 1) * overrides.get(f"{section}.epochs", 1)
        if key in values and n >= 0:
            out[key] = ok(key, n, {f"{section}.optim.lr_warmup_steps": n * per_step},
                          f"{n} steps x {per_step} updates a step" if per_step > 1 else "")
        elif key in values:
            out[key] = unused(key, n, "-1: the warm-up is lr_warmup_steps_ratio's")
        if ratio_key in values:
            ratio = _checked(as_float, ratio_key, values[ratio_key])
            updates = overrides.get("trainer.steps")
            if n >= 0:
                out[ratio_key] = unused(ratio_key, ratio, "lr_warmup_steps is given (verl uses it too)")
            elif ratio == 0:
                out[ratio_key] = unused(ratio_key, ratio, "no warm-up, rlcore's default")
            elif updates is None:
                out[ratio_key] = no(ratio_key, ratio, "the run's length is not known here (give "
                                                      "trainer.total_training_steps), so the ratio has no count")
            else:
                steps = int(ratio * updates)                 # verl: of the run's steps, rounded down
                out[ratio_key] = ok(ratio_key, ratio, {f"{section}.optim.lr_warmup_steps": steps * per_step},
                                    f"{steps} steps x {per_step} updates a step")
        return out
    return translate


def _verl(section: str) -> str:
    return A if section == "actor" else "critic"


def tensor_parallel(section: str) -> Group:
    def translate(values, given, overrides, families) -> dict[str, Line]:
        m = f"{_verl(section)}.megatron"
        tp_key, sp_key = f"{m}.tensor_model_parallel_size", f"{m}.sequence_parallel"
        tp = _checked(as_int, tp_key, given.get(tp_key, 1))
        out = {}
        sp = tp > 1
        if sp_key in values:
            asked = _checked(as_bool, sp_key, values[sp_key])
            sp = asked and tp > 1
            out[sp_key] = ok(sp_key, asked, {f"{section}.parallel.sp": sp},
                             "" if asked == sp else "verl turns it off at TP 1")
        if tp_key in values:
            out[tp_key] = ok(tp_key, tp, {f"{section}.parallel.tp": tp, f"{section}.parallel.sp": sp})
        return out
    return translate


def recompute(section: str) -> Group:
    def translate(values, given, overrides, families) -> dict[str, Line]:
        o = f"{_verl(section)}.megatron.override_transformer_config"
        gran_key, method_key, layers_key = (f"{o}.recompute_granularity", f"{o}.recompute_method",
                                            f"{o}.recompute_num_layers")
        gran = values.get(gran_key)
        out = {}
        if gran_key in values:
            if gran not in (None, "full", "selective"):
                out[gran_key] = no(gran_key, gran, "use full or selective")
            else:
                out[gran_key] = ok(gran_key, gran, {f"{section}.recompute": gran or "none"})
        for key, fine in ((method_key, ("uniform", None)), (layers_key, (1, None))):
            if key in values:
                value = values[key]
                if gran != "full" or value in fine:
                    out[key] = unused(key, value, "rlcore's full recompute keeps each layer's input (uniform, 1 "
                                                  "layer)" if gran == "full" else "used only with "
                                                  "recompute_granularity=full")
                else:
                    out[key] = no(key, value, "rlcore's full recompute keeps each layer's input only (megatron's "
                                              "uniform method with 1 layer)")
        return out
    return translate


def stages(section: str) -> Group:
    def translate(values, given, overrides, families) -> dict[str, Line]:
        o = f"{_verl(section)}.megatron.override_transformer_config"
        last_key = f"{o}.num_layers_in_last_pipeline_stage"
        emb_key, loss_key = f"{o}.account_for_embedding_in_pipeline_split", f"{o}.account_for_loss_in_pipeline_split"
        out = {}
        if last_key in values:
            last = _checked(as_int, last_key, values[last_key])
            out[last_key] = ok(last_key, last, {f"{section}.parallel.last_stage_layers": last})
        accounted = {k: _checked(as_bool, k, values[k]) for k in (emb_key, loss_key) if k in values}
        for key, on in accounted.items():
            if not on:
                out[key] = unused(key, on, "False: rlcore does not count it as a layer either")
        extra = sum(accounted.values())
        if extra:
            pp = overrides.get(f"{section}.parallel.pp", 1)
            layers = _num_layers(overrides)
            keys = [k for k, on in accounted.items() if on]
            if last_key in values:
                for k in keys:
                    out[k] = unused(k, True, "num_layers_in_last_pipeline_stage is given")
            elif pp == 1:
                for k in keys:
                    out[k] = unused(k, True, "one pipeline stage: nothing to split")
            elif layers is None:
                for k in keys:
                    out[k] = no(k, True, "the model's layer count is not known here (give model.path or a "
                                         "bundled model name) to place its layers")
            else:
                per_stage = math.ceil((layers + extra) / pp)
                last = layers - (pp - 1) * per_stage
                if last <= 0 or layers % pp == 0:
                    for k in keys:
                        out[k] = unused(k, True, f"{layers} layers split evenly over {pp} stages")
                else:
                    for k in keys:
                        out[k] = ok(k, True, {f"{section}.parallel.last_stage_layers": last},
                                    f"{layers} layers: {pp - 1} stages of {per_stage}, {last} on the last")
        return out
    return translate


def _num_layers(overrides: dict[str, Any]) -> int | None:
    from rlcore.config.schema import Config
    from rlcore.errors import ConfigError
    from rlcore.sizing import read_model_config

    cfg = Config()
    cfg.model.path = overrides.get("model.path", "")
    cfg.model.hf_config = overrides.get("model.hf_config", "")
    try:
        hf = read_model_config(cfg)
    except ConfigError:
        return None
    n = hf.get("num_hidden_layers")
    return int(n) if n else None


def hybrid(section: str) -> Group:
    def translate(values, given, overrides, families) -> dict[str, Line]:
        occ = f"{_verl(section)}.optim.override_optimizer_config"
        frac_key, on_key = f"{occ}.optimizer_offload_fraction", f"{occ}.optimizer_cpu_offload"
        on = _checked(as_bool, on_key, values.get(on_key, False))
        fraction = _checked(as_float, frac_key, values.get(frac_key, 0.0))      # megatron-core's defaults
        target = ({f"{section}.optim.name": "hybrid_adam", f"{section}.optim.offload_fraction": fraction}
                  if on and fraction > 0 else {})
        out = {}
        for key in (frac_key, on_key):
            if key not in values:
                continue
            if target:
                out[key] = ok(key, values[key], target)
            else:
                out[key] = unused(key, values[key], "the hybrid optimizer needs optimizer_cpu_offload=True and a "
                                                    "fraction > 0 (as in Megatron)")
        return out
    return translate


def tokens(section: str) -> Group:
    def translate(values, given, overrides, families) -> dict[str, Line]:
        v = _verl(section)
        on_key, len_key = f"{v}.use_dynamic_bsz", f"{v}.ppo_max_token_len_per_gpu"
        on = _checked(as_bool, on_key, given.get(on_key, False))
        budget = _checked(as_int, len_key, given.get(len_key, 16384 if section == "actor" else 32768))
        pack = overrides.get(f"{section}.parallel.cp", 1) == 1
        target = {f"{section}.max_tokens_per_micro_batch": budget, f"{section}.pack_sequences": pack}
        out = {}
        if on_key in values:
            out[on_key] = ok(on_key, on, target if on else {f"{section}.max_tokens_per_micro_batch": 0},
                             "" if pack else "context parallel: rows padded, not packed")
        if len_key in values:
            out[len_key] = ok(len_key, budget, target) if on else unused(len_key, budget,
                                                                       "used only with use_dynamic_bsz=True")
        return out
    return translate


def clip(values, given, overrides, families) -> dict[str, Line]:
    out = {}
    for side in ("low", "high"):
        key = f"{A}.clip_ratio_{side}"
        if key in values:
            out[key] = ok(key, values[key], {f"algorithm.clip_ratio_{side}": _checked(as_float, key, values[key])})
    key = f"{A}.clip_ratio"
    if key in values:
        ratio = _checked(as_float, key, values[key])
        sides = {f"algorithm.clip_ratio_{s}": ratio for s in ("low", "high") if f"{A}.clip_ratio_{s}" not in values}
        out[key] = ok(key, ratio, sides) if sides else unused(key, ratio, "clip_ratio_low and _high are given")
    return out


KL_ESTIMATORS = {"low_var_kl": "k3", "k3": "k3", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2"}


def kl(values, given, overrides, families) -> dict[str, Line]:
    """verl has two KL places (the loss: use_kl_loss, kl_loss_coef, kl_loss_type; the reward: use_kl_in_reward,
    kl_ctrl.*, kl_penalty); rlcore has one coefficient: GRPO puts it in the loss, PPO where kl_as says."""
    out = {}
    ppo = overrides.get("algorithm.name") == "ppo"
    in_loss = _checked(as_bool, f"{A}.use_kl_loss", given.get(f"{A}.use_kl_loss", False))
    in_reward = _checked(as_bool, "algorithm.use_kl_in_reward", given.get("algorithm.use_kl_in_reward", False))
    if in_loss and in_reward:
        out[f"{A}.use_kl_loss"] = no(f"{A}.use_kl_loss", True, "rlcore applies one KL term: use_kl_loss and "
                                                                "use_kl_in_reward are both True")
        return out
    for key, place, coef_key, est_key in ((f"{A}.use_kl_loss", "loss", f"{A}.kl_loss_coef", f"{A}.kl_loss_type"),
                                          ("algorithm.use_kl_in_reward", "reward", "algorithm.kl_ctrl.kl_coef",
                                           "algorithm.kl_penalty")):
        on = in_loss if place == "loss" else in_reward
        coef = _checked(as_float, coef_key, given.get(coef_key, 0.001))
        target: dict[str, Any] = {"algorithm.kl_coef": coef}
        if ppo:
            target["algorithm.kl_as"] = place
        if on and place == "reward" and not ppo:
            out[key] = no(key, True, "only PPO (adv_estimator=gae) puts the KL penalty in the reward in rlcore; "
                                     "use actor_rollout_ref.actor.use_kl_loss")
            continue
        if key in values:
            out[key] = ok(key, on, target) if on else unused(key, on, f"no KL in the {place}, rlcore's default")
        if coef_key in values:
            out[coef_key] = ok(coef_key, coef, target) if on else unused(coef_key, coef, f"used only with "
                                                                         f"{key.rsplit('.', 1)[1]}=True")
        if est_key in values:
            name = values[est_key]
            if name not in KL_ESTIMATORS:
                out[est_key] = no(est_key, name, f"rlcore's estimators are k1, k2, k3 (verl's "
                                                 f"{', '.join(KL_ESTIMATORS)})")
            elif on or place == "loss":
                out[est_key] = ok(est_key, name, {"algorithm.kl_estimator": KL_ESTIMATORS[name]})
            else:
                out[est_key] = unused(est_key, name, "used only with use_kl_in_reward=True")
    ctrl_type = values.get("algorithm.kl_ctrl.type", "fixed")
    if "algorithm.kl_ctrl.type" in values:
        out["algorithm.kl_ctrl.type"] = (unused("algorithm.kl_ctrl.type", ctrl_type, "fixed: rlcore's default")
                                         if ctrl_type == "fixed" else
                                         ok("algorithm.kl_ctrl.type", ctrl_type, {}, "adaptive: see target_kl"))
    for key, to in (("algorithm.kl_ctrl.target_kl", "algorithm.kl_target"),
                    ("algorithm.kl_ctrl.horizon", "algorithm.kl_horizon")):
        if key in values:
            value = _checked(as_float if to.endswith("target") else as_int, key, values[key])
            out[key] = (ok(key, value, {to: value}) if ctrl_type == "adaptive" and in_reward
                        else unused(key, value, "used only with kl_ctrl.type=adaptive and use_kl_in_reward=True"))
    return out


REF_DEFAULTS = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 1,
                "expert_tensor_parallel_size": 1, "context_parallel_size": 1,
                "virtual_pipeline_model_parallel_size": None, "sequence_parallel": True}


def ref_layout(values, given, overrides, families) -> dict[str, Line]:
    """The reference policy is built in the actor's layout in rlcore: the same sizes are fine, others refused."""
    out = {}
    for key, value in values.items():
        name = key.rsplit(".", 1)[1]
        actor = given.get(f"{A}.megatron.{name}", REF_DEFAULTS[name])
        if value == actor or (name == "expert_tensor_parallel_size" and {value, actor} <= {1, None}):
            out[key] = unused(key, value, "the actor's too: rlcore builds the reference in the actor's layout")
        else:
            out[key] = no(key, value, f"the actor's is {actor}: rlcore builds the reference in the actor's layout")
    return out


def evaluation(values, given, overrides, families) -> dict[str, Line]:
    sample_key, temp_key = f"{ARR}.rollout.val_kwargs.do_sample", f"{ARR}.rollout.val_kwargs.temperature"
    sample = _checked(as_bool, sample_key, given.get(sample_key, False))
    temperature = _checked(as_float, temp_key, given.get(temp_key, 0.0))
    target = {"trainer.eval_temperature": temperature if sample else 0.0}
    out = {}
    if sample_key in values:
        out[sample_key] = ok(sample_key, sample, target)
    if temp_key in values:
        out[temp_key] = ok(temp_key, temperature, target) if sample else unused(
            temp_key, temperature, "greedy evaluation (val_kwargs.do_sample is False, verl's default)")
    return out


def reward_fn(values, given, overrides, families) -> dict[str, Line]:
    path_key, name_key = "custom_reward_function.path", "custom_reward_function.name"
    path = values.get(path_key)
    name = _checked(as_str, name_key, values.get(name_key, "compute_score"))
    out = {}
    if path is None:
        out[name_key] = unused(name_key, name, "used only with custom_reward_function.path")
        return out
    target = {"task.reward_fn": f"{_checked(as_str, path_key, path)}:{name}"}
    out[path_key] = ok(path_key, path, target)
    if name_key in values:
        out[name_key] = ok(name_key, name, target)
    return out


def overlong(values, given, overrides, families) -> dict[str, Line]:
    cfg = "reward_model.reward_kwargs.overlong_buffer_cfg"
    on = _checked(as_bool, f"{cfg}.enable", given.get(f"{cfg}.enable", False))
    buffer = _checked(as_int, f"{cfg}.len", given.get(f"{cfg}.len", 0))
    factor = _checked(as_float, f"{cfg}.penalty_factor", given.get(f"{cfg}.penalty_factor", 1.0))
    max_len = _checked(as_int, "reward_model.reward_kwargs.max_resp_len",
                       given.get("reward_model.reward_kwargs.max_resp_len",
                                 overrides.get("rollout.max_response_len", 0)))
    target = {"algorithm.overlong_buffer": buffer, "algorithm.overlong_max_len": max_len,
              "algorithm.overlong_penalty": factor}
    out = {}
    if _checked(as_bool, f"{RM}.enable", given.get(f"{RM}.enable", False)):
        for key, value in values.items():     # verl's dapo manager returns the reward model's scores as they are
            out[key] = unused(key, value, "with reward_model.enable=True verl's reward is the reward model's score, "
                                          "without the overlong penalty")
        return out
    for key, value in values.items():
        out[key] = ok(key, value, target) if on else unused(key, value, "the overlong penalty is off (enable)")
    if on and given.get("reward_model.reward_manager") != "dapo":
        out[f"{cfg}.enable"] = no(f"{cfg}.enable", True, "the overlong penalty is the dapo reward manager's: set "
                                                         "reward_model.reward_manager=dapo")
    return out


def reward_model(values, given, overrides, families) -> dict[str, Line]:
    """verl's reward model (``reward_model.enable`` with ``model.path``) -> rlcore's ``reward_model`` section. Every
    key of the group has effect only with the reward model enabled, as in verl; then the reward is its score
    (``rlcore_verl.keys.reward_model_rows`` says why), the layout is the legacy Megatron workers' or the reward loop
    engine's TP, and the worker count is verl's own pool (``enable_resource_pool``) or the trainer's."""
    enable_key, path_key = f"{RM}.enable", f"{RM}.model.path"
    if not _checked(as_bool, enable_key, given.get(enable_key, False)):
        off = {key: unused(key, value, RM_OFF) for key, value in values.items()}
        if enable_key in off:
            off[enable_key] = unused(enable_key, False, "no reward model, verl's default: the reward functions score "
                                                        "every row")
        return off
    path = given.get(path_key)
    if path is None:
        return {enable_key: no(enable_key, True, "it needs the reward model's checkpoint: add "
                                                 "reward_model.model.path=<a Hugging Face sequence-classification "
                                                 "checkpoint directory>")}
    path = _checked(as_str, path_key, path)
    loop = _checked(as_bool, f"{RM}.use_reward_loop", given.get(f"{RM}.use_reward_loop", True))
    if loop and given.get("custom_reward_function.path"):
        return {enable_key: no(enable_key, True, "with custom_reward_function.path, verl's reward loop "
                                                 "(reward_model.use_reward_loop=True, its default) scores with that "
                                                 "function alone and hands it the reward model's server; rlcore gives "
                                                 "no function the reward model: set reward_model.use_reward_loop=False "
                                                 "for the reward model's score alone (as verl's legacy workers), or "
                                                 "drop custom_reward_function.path and add both in rlcore keys: "
                                                 "task.reward_fn=<file.py>:<function> task.rewards={rm: 1.0, "
                                                 "<function>: 1.0}")}
    out: dict[str, Line] = {}
    m = f"{RM}.megatron"
    # the layout's TP: the legacy Megatron workers' or the reward loop's engine's, as use_reward_loop picks
    tp_keys = [k for k in (f"{m}.tensor_model_parallel_size", f"{RM}.rollout.tensor_model_parallel_size")
               if k in given]
    if len(tp_keys) == 2:
        used = tp_keys[1] if loop else tp_keys[0]
        other = tp_keys[0] if loop else tp_keys[1]
        out[other] = unused(other, given[other], f"reward_model.use_reward_loop={loop}: verl takes the reward "
                                                 f"model's TP from {used}")
        tp_keys = [used]
    tp = _checked(as_int, tp_keys[0], given[tp_keys[0]]) if tp_keys else 1
    sp_key = f"{m}.sequence_parallel"
    asked = _checked(as_bool, sp_key, given.get(sp_key, True))
    sp = asked and tp > 1
    if tp_keys:
        out[tp_keys[0]] = ok(tp_keys[0], tp, {f"{RM}.parallel.tp": tp, f"{RM}.parallel.sp": sp})
    if sp_key in values:
        out[sp_key] = ok(sp_key, asked, {f"{RM}.parallel.sp": sp}, "" if asked == sp else "verl turns it off at TP 1")
    # micro-batches by a token budget: the reward model's keys, else the critic's (verl's interpolation), else the
    # actor's use_dynamic_bsz (the critic's default)
    dyn_key, len_key = f"{RM}.use_dynamic_bsz", f"{RM}.forward_max_token_len_per_gpu"
    dyn_from = next((k for k in (dyn_key, "critic.use_dynamic_bsz", f"{A}.use_dynamic_bsz") if k in given), None)
    dyn = _checked(as_bool, dyn_from, given[dyn_from]) if dyn_from else False
    len_from = next((k for k in (len_key, "critic.forward_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu")
                     if k in given), None)
    budget = _checked(as_int, len_from, given[len_from]) if len_from else 32768
    pack = _checked(as_int, f"{m}.context_parallel_size", given.get(f"{m}.context_parallel_size", 1)) == 1
    tokens = ({f"{RM}.max_tokens_per_micro_batch": budget, f"{RM}.pack_sequences": pack} if dyn
              else {f"{RM}.max_tokens_per_micro_batch": 0})
    if dyn_key in values:
        out[dyn_key] = ok(dyn_key, dyn, tokens, "" if pack else "context parallel: rows padded, not packed")
    if len_key in values:
        out[len_key] = ok(len_key, budget, tokens) if dyn else unused(len_key, budget,
                                                                    "used only with use_dynamic_bsz=True")
    # where it runs
    pool_key, gpus_key, nodes_key = f"{RM}.enable_resource_pool", f"{RM}.n_gpus_per_node", f"{RM}.nnodes"
    pool = _checked(as_bool, pool_key, given.get(pool_key, False))
    gpus = _checked(as_int, gpus_key, given.get(gpus_key, 8))            # verl's reward-loop defaults
    nodes = _checked(as_int, nodes_key, given.get(nodes_key, 0))
    if pool and (gpus < 1 or nodes < 1):
        return {pool_key: no(pool_key, True, f"its pool is reward_model.n_gpus_per_node x nnodes devices ({gpus} x "
                                             f"{nodes}): give both, > 0")}
    for key in (pool_key, gpus_key, nodes_key):
        if key in values:
            out[key] = (ok(key, given[key], {f"{RM}.world_size": gpus * nodes}, f"{nodes} x {gpus} devices")
                        if pool else unused(key, given[key], "no pool of its own (enable_resource_pool=False, verl's "
                                                             "default): as many workers as it scores for, rlcore's "
                                                             "reward_model.world_size=0"))
    # the switch and the checkpoint
    target: dict[str, Any] = {f"{RM}.path": path}
    notes = ["the reward model's score is the reward; the rule-based reward is logged beside it at weight 0"]
    if f"{m}.dtype" not in given:
        target[f"{RM}.dtype"] = "bfloat16"
        notes.append("bfloat16: verl's default")
    if dyn and dyn_key not in given:
        target.update(tokens)
        notes.append(f"micro-batches of {budget} tokens: {dyn_from}, verl's default for it")
    out[enable_key] = ok(enable_key, True, target, "; ".join(notes))
    if path_key in values:
        out[path_key] = ok(path_key, path, {f"{RM}.path": path}, "" if os.path.isfile(os.path.join(
            os.path.expanduser(path), "config.json")) else "not on this machine: the run will say so")
    for key, value in values.items():                # the rest: a value each, or no effect / refused as the row says
        if key not in out:
            out[key] = _row_line(key, value, lookup(key))
    return out


def _row_line(key: str, value: Any, row: Key | None) -> Line:
    """One key read by its row alone (``translate._single``'s rules, as a Line)."""
    assert row is not None
    if row.status == TRANSLATED:
        assert row.convert is not None
        try:
            return ok(key, value, dict(zip(row.to, row.convert(value))))
        except Refused as e:
            raise refusal(key, value, e.why, e.closest or ", ".join(row.to)) from None
    if row.accepts and value not in row.accepts:
        return no(key, value, f"{row.why} (only {' or '.join(show(a) for a in row.accepts)} has a counterpart)")
    if row.status == REFUSED and not row.accepts:
        return no(key, value, row.why)
    return unused(key, value, row.why if row.status == IGNORED else f"{show(value)} is rlcore's behaviour too "
                                                                    f"({row.why})")


def rejection(values, given, overrides, families) -> dict[str, Line]:
    """verl's rejection sampling -> rlcore's: only seq_mean_k1 (the sequence's geometric-mean ratio) is rlcore's."""
    rs_key, th_key = "algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs_threshold"
    option, spec = given.get(rs_key), given.get(th_key)
    out = {}
    if option is None:
        for key, value in values.items():
            out[key] = unused(key, value, "no rejection (rollout_rs is null)")
        return out
    if option != "seq_mean_k1":
        out[rs_key] = no(rs_key, option, "rlcore rejects by the sequence's geometric-mean ratio only (verl's "
                                         "seq_mean_k1)")
        return out
    if spec is None:
        out[rs_key] = no(rs_key, option, "it needs rollout_rs_threshold (as in verl)")
        return out
    text = str(spec)
    try:
        low_text, high_text = text.split("_", 1) if "_" in text else (None, text)
        high = float(high_text)
        low = float(low_text) if low_text is not None else 1.0 / high
    except ValueError:
        out[th_key] = no(th_key, spec, "give upper or lower_upper, numbers")
        return out
    target = {"algorithm.rollout_rs_low": low, "algorithm.rollout_rs_high": high}
    for key, value in values.items():
        out[key] = ok(key, value, target)
    return out


def resume(values, given, overrides, families) -> dict[str, Line]:
    mode_key, path_key = "trainer.resume_mode", "trainer.resume_from_path"
    mode = _checked(as_str, mode_key, given.get(mode_key, "auto"))
    path = given.get(path_key)
    out = {}
    if mode not in ("auto", "disable", "resume_path"):
        out[mode_key] = no(mode_key, mode, "use auto, disable or resume_path")
    elif mode == "resume_path" and not path:
        out[mode_key] = no(mode_key, mode, "it needs trainer.resume_from_path")
    else:
        target = {"trainer.resume": {"auto": "auto", "disable": ""}.get(mode, path)}
        if mode_key in values:
            out[mode_key] = ok(mode_key, mode, target)
        if path_key in values:
            out[path_key] = ok(path_key, path, target) if mode == "resume_path" else unused(
                path_key, path, "used only with resume_mode=resume_path")
    return out


# in order: data and model first, the batch before the steps it divides, the steps before warm-up ratios
GROUPS: dict[str, Group] = {
    "data": data, "model": model, "batch": batch, "world": world, "steps": steps,
    **{f"{s}_{name}": make(s) for s in ("actor", "critic") for name, make in (
        ("tp", tensor_parallel), ("warmup", warmup), ("recompute", recompute), ("stages", stages),
        ("hybrid", hybrid), ("tokens", tokens))},
    "clip": clip, "kl": kl, "ref_layout": ref_layout, "eval": evaluation, "reward_fn": reward_fn,
    "overlong": overlong, "reward_model": reward_model, "rs": rejection, "resume": resume,
}

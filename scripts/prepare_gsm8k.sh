#!/usr/bin/env bash
# GSM8K's public JSONL (github.com/openai/grade-school-math: grade_school_math/data/{train,test}.jsonl) as the
# verl-schema Parquet files the qwen3-8b-gsm8k-8gpu preset reads (data_source openai/gsm8k, scored by the gsm8k
# reward). Usage: scripts/prepare_gsm8k.sh <dir with train.jsonl and test.jsonl> [out dir, default ~/data/gsm8k]
set -euo pipefail
src=${1:?usage: scripts/prepare_gsm8k.sh <dir with train.jsonl and test.jsonl> [out dir]}
out=${2:-$HOME/data/gsm8k}
rlcore=${RLCORE:-rlcore}
$rlcore dataset gsm8k "$src/train.jsonl" "$out/train.parquet" --split train
$rlcore dataset gsm8k "$src/test.jsonl" "$out/test.parquet" --split test

#!/usr/bin/env bash
# bench/gpu_gateway_vs_engine.py on a GPU host that has torch but not the project's other
# dependencies and no network (the device machine of docs/gpu.md). Carry bench/wheels/ (made here
# by `bash bench/gpu_prepare.sh`): the project's dependencies as cp312 wheels, transformers at the
# floor pyproject.toml sets, and SmolLM2's config and tokenizer under bench/wheels/smollm2/.
# Builds two random-weight bf16 models (bench/gpu_models.py: SmolLM2-135M's shape and
# Llama-3.2-1B's) and runs the comparison; the table goes to stdout, the JSON to $OUT.
#   bash bench/gpu_gateway_vs_engine.sh [--models smollm2,llama1b] [--script bench/gpu_ttft_trace.py] [bench options...]
# WHEELS=.devkit/wheels TOKENIZER=.devkit/smollm2: bench/device_kit.sh's kit instead of bench/wheels.
set -euo pipefail
OUT=${OUT:-bench/results}
SHAPES=smollm2,llama1b
SCRIPT=bench/gpu_gateway_vs_engine.py
if [ "${1:-}" = "--models" ]; then SHAPES=$2; shift 2; fi
if [ "${1:-}" = "--script" ]; then SCRIPT=$2; shift 2; fi
WHEELS=${WHEELS:-bench/wheels}
TOKENIZER=${TOKENIZER:-$WHEELS/smollm2}
SITE=/tmp/tollgate-site; rm -rf "$SITE"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOLLGATE_EMBEDDINGS=off PYTHONUNBUFFERED=1
python3 -c 'import transformers, torch; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
MODELS=()
for shape in ${SHAPES//,/ }; do
  dir=/tmp/tollgate-models/$shape
  [ -f "$dir/config.json" ] || python3 bench/gpu_models.py "$dir" --shape "$shape" --tokenizer "$TOKENIZER" >&2
  MODELS+=(--model "$shape=$dir")
done
python3 "$SCRIPT" "${MODELS[@]}" --json "$OUT/$(basename "$SCRIPT" .py).json" "$@"

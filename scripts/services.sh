#!/usr/bin/env bash
# Makes sure the Postgres and Redis the tests use are reachable.
# Starts local servers that are installed but stopped; says what is missing otherwise.
set -uo pipefail

PGHOST="${TOLLGATE_TEST_PGHOST:-127.0.0.1}"
PGPORT="${TOLLGATE_TEST_PGPORT:-5432}"
REDIS_HOST="${TOLLGATE_TEST_REDIS_HOST:-127.0.0.1}"
REDIS_PORT="${TOLLGATE_TEST_REDIS_PORT:-6379}"

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

wait_port() {
    for _ in $(seq 1 50); do port_open "$1" "$2" && return 0; sleep 0.2; done
    return 1
}

status=0

if port_open "$PGHOST" "$PGPORT"; then
    echo "services: postgres reachable on $PGHOST:$PGPORT"
elif command -v pg_ctlcluster >/dev/null 2>&1 && ls /etc/postgresql >/dev/null 2>&1; then
    echo "services: starting the local postgres cluster"
    for v in $(ls /etc/postgresql); do
        pg_ctlcluster --skip-systemctl-redirect "$v" main start || true
    done
    wait_port "$PGHOST" "$PGPORT" && echo "services: postgres started" \
        || { echo "services: ERROR postgres is installed but did not start on $PGHOST:$PGPORT" >&2; status=1; }
else
    echo "services: ERROR postgres is not reachable on $PGHOST:$PGPORT and no local server is installed." >&2
    echo "          Install it (apt-get install postgresql) or point TOLLGATE_TEST_PGHOST/PGPORT at one." >&2
    status=1
fi

if port_open "$REDIS_HOST" "$REDIS_PORT"; then
    echo "services: redis reachable on $REDIS_HOST:$REDIS_PORT"
elif command -v redis-server >/dev/null 2>&1; then
    echo "services: starting a local redis-server (nothing kept on disk)"
    mkdir -p /tmp/tollgate-redis
    redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
        --dir /tmp/tollgate-redis --logfile /tmp/tollgate-redis/redis.log
    wait_port "$REDIS_HOST" "$REDIS_PORT" && echo "services: redis started" \
        || { echo "services: ERROR redis is installed but did not start on $REDIS_HOST:$REDIS_PORT" >&2; status=1; }
else
    echo "services: ERROR redis is not reachable on $REDIS_HOST:$REDIS_PORT and redis-server is not installed." >&2
    echo "          Install it (apt-get install redis-server) or point TOLLGATE_TEST_REDIS_HOST/PORT at one." >&2
    status=1
fi

exit $status

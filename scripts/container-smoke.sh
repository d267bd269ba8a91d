#!/usr/bin/env bash
# The composed stack, end to end: build the images compose.yaml names, bring the stack up (PostgreSQL, the service,
# one worker) with podman-compose, wait for /readyz, check that the dashboard at / and its assets come from the
# stack, run a small verify job through the API to completion on the worker, check its results are in PostgreSQL,
# then tear everything down (volumes too). Prints how long the build, `up` and the first ready took. Exits non-zero
# with one "container smoke: FAILED: ..." line saying what went wrong. Not part of `make test` (minutes, needs
# podman): `make container-smoke`, as root on a Debian machine (it installs podman, runc, debootstrap when missing).
#
# Settings (environment):
#   MC_HTTP_PORT=8700 MC_PG_PORT=55500   ports; with host networking they are the host's and must be free
#   SMOKE_NETWORK=bridge                 bridge: compose.yaml as it is, the stack on a network of its own, the
#                                        service's port published; host: plus compose.host.yaml, every container on
#                                        the host's network (where containers get no network of their own)
#   PODMAN_RUNTIME=runc                  the OCI runtime podman uses (crun refuses this sandbox's cgroups); empty:
#                                        podman's default
#   BASE_IMAGE=localhost/bookworm-min    the base of both images; the default is debootstrapped here when missing
#                                        (no image registry is needed); set python:3.11-slim where one is reachable
#   SMOKE_KEEP=1                         leave the stack running at the end (tear it down with the printed command)
#   SMOKE_EXTRA_COMPOSE=FILE             one more compose file, merged last (to try a change without editing these)
set -euo pipefail
cd "$(dirname "$0")/.."

HTTP_PORT=${MC_HTTP_PORT:-8700}
PG_PORT=${MC_PG_PORT:-55500}
NETWORK=${SMOKE_NETWORK:-bridge}
RUNTIME=${PODMAN_RUNTIME-runc}
BASE=${BASE_IMAGE:-localhost/bookworm-min}
ROOTFS=${ROOTFS:-/var/tmp/multicomposite-bookworm}
PROJECT=multicomposite-smoke
COMPOSE_VERSION=1.6.0
BASE_URL="http://127.0.0.1:$HTTP_PORT"

fail() {
    echo "container smoke: FAILED: $*" >&2
    exit 1
}
now() { date +%s.%N; }
seconds_since() { awk -v start="$1" -v end="$(now)" 'BEGIN { printf "%.1f", end - start }'; }

case "$NETWORK" in
    host) COMPOSE_FILES=(-f compose.yaml -f compose.host.yaml); PG_HOST=127.0.0.1 ;;
    bridge) COMPOSE_FILES=(-f compose.yaml); PG_HOST=postgres ;;
    *) fail "SMOKE_NETWORK=$NETWORK is not a mode; use host or bridge" ;;
esac
if [ -n "${SMOKE_EXTRA_COMPOSE:-}" ]; then
    [ -f "$SMOKE_EXTRA_COMPOSE" ] || fail "SMOKE_EXTRA_COMPOSE=$SMOKE_EXTRA_COMPOSE is not a file"
    COMPOSE_FILES+=(-f "$SMOKE_EXTRA_COMPOSE")
fi

# --- tools -------------------------------------------------------------------------------------------------------
missing=()
for tool in podman curl python3; do command -v "$tool" >/dev/null || missing+=("$tool"); done
[ -n "$RUNTIME" ] && ! command -v "$RUNTIME" >/dev/null && missing+=("$RUNTIME")
if [ "$BASE" = localhost/bookworm-min ] && ! command -v debootstrap >/dev/null; then missing+=(debootstrap); fi
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
        || fail "missing ${missing[*]}; install them (Debian: apt-get install podman runc debootstrap curl)"
    echo "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap curl >/dev/null
fi
# Podman's default ulimits are refused in some sandboxes (this one); an empty list keeps the runtime's own.
CONF=/etc/containers/containers.conf
if [ "$(id -u)" = 0 ] && ! grep -qs default_ulimits "$CONF"; then
    mkdir -p /etc/containers
    printf '[containers]\ndefault_ulimits = []\n' >> "$CONF"
fi
COMPOSE=${PODMAN_COMPOSE:-}
if [ -z "$COMPOSE" ]; then
    COMPOSE=.venv-compose/bin/podman-compose
    installed=$("$COMPOSE" --version 2>/dev/null || true)
    if [[ "$installed" != *"podman-compose version $COMPOSE_VERSION"* ]]; then
        echo "installing podman-compose $COMPOSE_VERSION into .venv-compose"
        python3 -m venv .venv-compose || fail "python3 -m venv failed; install python3-venv"
        .venv-compose/bin/pip install --quiet "podman-compose==$COMPOSE_VERSION" \
            || fail "pip could not install podman-compose==$COMPOSE_VERSION"
    fi
fi
PODMAN=(podman ${RUNTIME:+--runtime "$RUNTIME"})
COMPOSE_CMD=("$COMPOSE" --no-ansi -p "$PROJECT" ${RUNTIME:+--podman-args "--runtime $RUNTIME"} "${COMPOSE_FILES[@]}")

# --- base image: a local Debian when no registry can be reached -----------------------------------------------------
if [ "$BASE" = localhost/bookworm-min ] && ! "${PODMAN[@]}" image exists "$BASE"; then
    started=$(now)
    if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
        echo "debootstrapping Debian bookworm into $ROOTFS (minutes)"
        rm -rf "$ROOTFS"
        debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm "$ROOTFS" \
            >/dev/null || fail "debootstrap bookworm $ROOTFS failed (is the Debian mirror reachable?)"
    fi
    tar -C "$ROOTFS" -c . | "${PODMAN[@]}" import - "$BASE" >/dev/null || fail "podman import of $ROOTFS failed"
    echo "base image $BASE: $(seconds_since "$started") s"
fi

# --- build -------------------------------------------------------------------------------------------------------
# pip inside the build uses this machine's CA bundle and local wheel directory when pip is configured with them
# (a re-signing proxy, torch from disk); elsewhere the Dockerfile's defaults fetch CPU-only torch.
CERT=$(pip config list 2>/dev/null | sed -n "s/^global.cert='\(.*\)'/\1/p" || true)
WHEELS=$(pip config list 2>/dev/null | sed -n "s/^global.find-links='\(.*\)'/\1/p" || true)
build_args=(--network=host --build-arg BASE_IMAGE="$BASE")
if [ -n "$CERT" ] && [ -f "$CERT" ]; then
    build_args+=(-v "$CERT:/host-ca.crt:ro" --build-arg PIP_CERT=/host-ca.crt)
fi
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
    build_args+=(-v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL=)
fi
started=$(now)
BUILD_LOG=/tmp/$PROJECT-build.log
"${PODMAN[@]}" build --format docker "${build_args[@]}" -t localhost/multicomposite . >"$BUILD_LOG" 2>&1 \
    || { tail -n 30 "$BUILD_LOG" >&2; fail "building localhost/multicomposite (log: $BUILD_LOG)"; }
"${PODMAN[@]}" build --format docker --network=host --build-arg BASE_IMAGE="$BASE" \
    -t localhost/multicomposite-postgres containers/postgres >>"$BUILD_LOG" 2>&1 \
    || { tail -n 30 "$BUILD_LOG" >&2; fail "building localhost/multicomposite-postgres (log: $BUILD_LOG)"; }
build_s=$(seconds_since "$started")
echo "build (both images): $build_s s"

# --- up ----------------------------------------------------------------------------------------------------------
export MC_HTTP_PORT=$HTTP_PORT MC_PG_PORT=$PG_PORT MC_PG_HOST=$PG_HOST
MC_PG_PASSWORD=$(python3 -c 'import secrets; print(secrets.token_urlsafe(18))')
export MC_PG_PASSWORD
teardown() {
    if [ "${SMOKE_KEEP:-0}" = 1 ]; then
        echo "stack left running; tear it down with: MC_PG_PASSWORD=x ${COMPOSE_CMD[*]} down -v"
        return
    fi
    "${COMPOSE_CMD[@]}" down -v -t 10 >/dev/null 2>&1 || true
}
show_logs() {
    for name in postgres migrate service worker; do
        echo "--- logs of $name (last 20 lines)" >&2
        "${COMPOSE_CMD[@]}" logs --tail 20 "$name" >&2 2>&1 || true
    done
}
"${COMPOSE_CMD[@]}" down -v -t 5 >/dev/null 2>&1 || true  # a stack left from an earlier, interrupted run
# Something else answering on the ports would make every check below pass against the wrong server.
for port in "$HTTP_PORT" "$PG_PORT"; do
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        fail "port $port on 127.0.0.1 is already in use; stop what listens there or set MC_HTTP_PORT / MC_PG_PORT"
    fi
done
trap teardown EXIT
started=$(now)
"${COMPOSE_CMD[@]}" up -d >/tmp/"$PROJECT"-up.log 2>&1 \
    || { tail -n 30 /tmp/"$PROJECT"-up.log >&2; show_logs; fail "podman-compose up (log: /tmp/$PROJECT-up.log)"; }
up_s=$(seconds_since "$started")
echo "up: $up_s s"

ready=""
deadline=$((SECONDS + 240))
while [ "$SECONDS" -lt "$deadline" ]; do
    if curl -fsS --max-time 2 "$BASE_URL/readyz" >/dev/null 2>&1; then ready=yes; break; fi
    sleep 1
done
[ -n "$ready" ] || { show_logs; fail "$BASE_URL/readyz did not answer 200 within 240 s of up"; }
ready_s=$(seconds_since "$started")
echo "first ready (from the start of up): $ready_s s"

# --- checks ------------------------------------------------------------------------------------------------------
container_of() {
    "${PODMAN[@]}" ps -a -q --filter "label=io.podman.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1"
}
# The schema came from the migrate container (the service only waited for it): it must have finished, and cleanly.
migrate_id=$(container_of migrate)
[ -n "$migrate_id" ] || fail "no migrate container in project $PROJECT"
migrate_exit=$(timeout 60 "${PODMAN[@]}" wait "$migrate_id") \
    || { show_logs; fail "migrate (multicomposite db upgrade) has not exited 60 s after the service was ready"; }
[ "$migrate_exit" = 0 ] || { show_logs; fail "migrate (multicomposite db upgrade) exited $migrate_exit, not 0"; }
echo "migrate: exited 0"
service_id=$(container_of service)
[ -n "$service_id" ] || fail "no service container in project $PROJECT"
# The answer must come from the container: its own loopback (the same as the host's under host networking, a
# different one under bridge) serves the same page.
page=$(curl -fsS --max-time 5 "$BASE_URL/") || fail "GET $BASE_URL/ failed"
grep -q '<title>multicomposite dashboard</title>' <<<"$page" \
    || fail "GET / is not the dashboard page (no <title>multicomposite dashboard</title>)"
inside=$("${PODMAN[@]}" exec "$service_id" python3 -c "import urllib.request; print(urllib.request.urlopen(
    'http://127.0.0.1:$HTTP_PORT/', timeout=5).read().decode())") || fail "the service container does not serve /"
[ "$inside" = "$page" ] || fail "the page on $BASE_URL/ differs from the one the service container serves"
for asset in dashboard/dashboard.js dashboard/dashboard.css; do
    curl -fsS --max-time 5 -o /dev/null "$BASE_URL/$asset" || fail "GET $BASE_URL/$asset (the dashboard's asset) failed"
done
echo "dashboard: / and its assets served by the stack's service"

# The service reaches PostgreSQL: a small verify job goes through the API, runs on the worker, and its rows are
# read back from PostgreSQL itself (where there were none before).
postgres_id=$(container_of postgres)
[ -n "$postgres_id" ] || fail "no postgres container in project $PROJECT"
count_rows() {
    "${PODMAN[@]}" exec "$postgres_id" psql -h /var/run/postgresql -p "$PG_PORT" -U multicomposite \
        -d multicomposite -tAc "SELECT count(*) FROM matrix_entries WHERE op = 'index_fill'"
}
rows=$(count_rows) || fail "psql in the postgres container failed: $rows"
[ "$rows" = 0 ] || fail "PostgreSQL holds $rows matrix_entries rows for index_fill before the verify job, not 0"
job=$(curl -fsS --max-time 10 -X POST -H 'Content-Type: application/json' \
    -d '{"ops": ["index_fill"], "stacks": ["vmap"], "dtypes": ["float32"]}' "$BASE_URL/verify") \
    || fail "POST $BASE_URL/verify was refused"
job_id=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["id"])' <<<"$job") \
    || fail "POST /verify answered without a job id: $job"
state=""
deadline=$((SECONDS + 240))
while [ "$SECONDS" -lt "$deadline" ]; do
    job=$(curl -fsS --max-time 5 "$BASE_URL/jobs/$job_id") || fail "GET /jobs/$job_id failed"
    state=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["state"])' <<<"$job")
    case "$state" in done|failed|cancelled|interrupted) break ;; esac
    sleep 1
done
case "$state" in
    done) ;;
    failed|cancelled|interrupted) show_logs; fail "verify job $job_id ended $state, not done: $job" ;;
    *) show_logs; fail "verify job $job_id is still $state 240 s after it was posted: $job" ;;
esac
echo "verify job $job_id: done"
worker_id=$(container_of worker)
[ -n "$worker_id" ] || fail "no worker container in project $PROJECT"
# The worker logs "job ID: done" when it has run a job (service/worker.py).
worker_log=$("${PODMAN[@]}" logs "$worker_id" 2>&1)
[[ "$worker_log" == *"job $job_id: done"* ]] \
    || { show_logs; fail "the worker's log has no \"job $job_id: done\": the job did not run there"; }
echo "verify job $job_id: ran on the worker"
rows=$(count_rows) || fail "psql in the postgres container failed: $rows"
[ "$rows" -gt 0 ] || fail "PostgreSQL holds no matrix_entries rows for index_fill after the verify job"
echo "postgres: $rows matrix_entries rows for index_fill"
matrix=$(curl -fsS --max-time 10 "$BASE_URL/matrix?op=index_fill") || fail "GET /matrix?op=index_fill failed"
grep -q '"index_fill"' <<<"$matrix" || fail "GET /matrix?op=index_fill does not show the verified op: $matrix"

echo "container smoke: ok (build $build_s s, up $up_s s, first ready $ready_s s)"

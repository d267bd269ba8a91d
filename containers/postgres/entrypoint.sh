#!/bin/sh
# First start: initialise $PGDATA with a password-protected superuser POSTGRES_USER and a database POSTGRES_DB, and
# accept password logins from any address (the container's network is the boundary). Every start: run postgres in
# the foreground on PGPORT, listening on POSTGRES_LISTEN (default: all addresses), so `podman stop` shuts it down
# cleanly (SIGTERM: smart shutdown).
set -eu
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
: "${PGPORT:=5432}"
: "${POSTGRES_LISTEN:=*}"
if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "postgres-entrypoint: POSTGRES_PASSWORD is not set; set it in the environment (compose.yaml reads" \
         "MULTICOMPOSITE_PG_PASSWORD)" >&2
    exit 2
fi
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    echo "postgres-entrypoint: initialising $PGDATA for user $POSTGRES_USER, database $POSTGRES_DB"
    password_file=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$password_file"
    initdb --pgdata="$PGDATA" --username="$POSTGRES_USER" --pwfile="$password_file" \
        --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$password_file"
    printf 'host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n' >> "$PGDATA/pg_hba.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
        # A private socket directory and no TCP listener: nothing can connect before the database exists.
        postgres -D "$PGDATA" -c listen_addresses='' -c unix_socket_directories=/tmp -p "$PGPORT" &
        setup_pid=$!
        until pg_isready -q -h /tmp -p "$PGPORT" -U "$POSTGRES_USER" -d postgres; do sleep 0.2; done
        createdb -h /tmp -p "$PGPORT" -U "$POSTGRES_USER" "$POSTGRES_DB"
        kill -TERM "$setup_pid"
        wait "$setup_pid" || true
    fi
fi
exec postgres -D "$PGDATA" -c listen_addresses="$POSTGRES_LISTEN" -c port="$PGPORT" \
    -c unix_socket_directories=/var/run/postgresql "$@"

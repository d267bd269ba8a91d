#!/usr/bin/env bash
# Build the project's Dockerfile with podman on a locally made Debian base (no image registry is reachable here),
# run the container, and check /healthz and /select from the host. Not part of CI: run it by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOTFS=${ROOTFS:-/var/tmp/multicomposite-bookworm}
BASE=localhost/bookworm-min
IMAGE=localhost/multicomposite
PORT=${PORT:-18000}

if ! command -v podman >/dev/null; then
    apt-get update && apt-get install -y podman runc debootstrap
fi
if [ ! -f /etc/containers/containers.conf ] || ! grep -q default_ulimits /etc/containers/containers.conf; then
    mkdir -p /etc/containers
    printf '[containers]\ndefault_ulimits = []\n' >> /etc/containers/containers.conf
fi
if ! podman --runtime runc image exists "$BASE"; then
    [ -d "$ROOTFS" ] || debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$ROOTFS"
    tar -C "$ROOTFS" -c . | podman --runtime runc import - "$BASE"
fi
CERT=$(pip config list 2>/dev/null | sed -n "s/^global.cert='\(.*\)'/\1/p")
WHEELS=$(pip config list 2>/dev/null | sed -n "s/^global.find-links='\(.*\)'/\1/p")
podman --runtime runc build --format docker --network=host \
    -v "${WHEELS:-/opt/wheels}:/wheels:ro" -v "${CERT:-/etc/ssl/certs/ca-certificates.crt}:/host-ca.crt:ro" \
    --build-arg PIP_FIND_LINKS=/wheels --build-arg PIP_CERT=/host-ca.crt --build-arg BASE_IMAGE="$BASE" \
    --build-arg TORCH_INDEX_URL= \
    -t "$IMAGE" .
podman --runtime runc rm -f multicomposite-smoke >/dev/null 2>&1 || true
podman --runtime runc run -d --name multicomposite-smoke --network=host -e MULTICOMPOSITE_PORT="$PORT" "$IMAGE"
trap 'podman --runtime runc rm -f multicomposite-smoke >/dev/null 2>&1 || true' EXIT
for _ in $(seq 1 60); do
    curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
    sleep 2
done
echo "healthz: $(curl -fsS "http://127.0.0.1:$PORT/healthz")"
echo "select:  $(curl -fsS "http://127.0.0.1:$PORT/select?op=index_fill&stack=vmap,grad&batched=value")"
echo "user:    $(podman --runtime runc exec multicomposite-smoke id -u)"
echo "container smoke: ok"

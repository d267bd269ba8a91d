# multicomposite HTTP service. Multi-stage: the build stage makes a venv with CPU-only torch; the runtime stage copies
# it. BASE_IMAGE defaults to python:3.11-slim; a bare Debian works too (python3 and python3-venv are installed when
# missing). Behind a TLS-intercepting proxy or with a local wheel directory, pass PIP_CERT / PIP_FIND_LINKS.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG PIP_CERT
ARG PIP_FIND_LINKS
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
SHELL ["/bin/sh", "-eu", "-c"]
RUN if ! command -v python3 >/dev/null || ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi
# What compiles use()'s C++ routing kernels (registry/core/kernels): a compiler, functorch's json header, Python's
# headers where the base image lacks them. Only this stage has them: the runtime stage copies the compiled kernels.
RUN apt-get update && apt-get install -y --no-install-recommends g++ nlohmann-json3-dev \
    && if [ ! -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]; then \
        apt-get install -y --no-install-recommends python3-dev; \
    fi \
    && rm -rf /var/lib/apt/lists/*
# torch first, pinned and CPU-only (no CUDA wheels in the image), so the project's torch>=2.13,<2.14 keeps it; in a
# layer of its own, before the sources, so that a change to the code does not install torch again.
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY registry ./registry
COPY composites ./composites
COPY service ./service
# What the image serves: the HTTP service with its store, on PostgreSQL, and the workers (compose runs all three from
# this image). Not the plots extra: the API renders no PNG. The routing kernels are compiled here, once (about a
# minute), never at the first use() of a running container.
RUN /opt/venv/bin/pip install '.[service,postgres,workers]' torch==2.13.0 \
    && MULTICOMPOSITE_KERNELS_DIR=/opt/kernels /opt/venv/bin/multicomposite build-kernels

FROM ${BASE_IMAGE} AS runtime
SHELL ["/bin/sh", "-eu", "-c"]
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && (getent passwd multicomposite >/dev/null || useradd --create-home --uid 10001 multicomposite) \
    && mkdir -p /data && chown multicomposite /data
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/kernels /opt/kernels
# Used by compose.yaml: the containers that need PostgreSQL wait for it (see the script for why).
COPY --chmod=0755 containers/multicomposite/wait-for-store.py /usr/local/bin/wait-for-store
ENV PATH=/opt/venv/bin:$PATH \
    MULTICOMPOSITE_KERNELS_DIR=/opt/kernels \
    MULTICOMPOSITE_DB=sqlite:////data/multicomposite.db \
    MULTICOMPOSITE_HOST=0.0.0.0 \
    MULTICOMPOSITE_PORT=8000
VOLUME ["/data"]
USER 10001
EXPOSE 8000
# Healthy means ready: /readyz answers 200 only while the store answers a query (503 with the reason otherwise). It asks
# the port the service listens on, which MULTICOMPOSITE_PORT may move (compose does, for host networking).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('MULTICOMPOSITE_PORT', '8000'), timeout=4)"]
CMD ["multicomposite", "serve"]

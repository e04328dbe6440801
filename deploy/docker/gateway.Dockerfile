# syntax=docker/dockerfile:1
# The llamamesh gateway: the base package only (no [cpu] extra), so no torch and no GPU library.
#   docker build -f deploy/docker/gateway.Dockerfile -t llamamesh-gateway .     (context: repo root)
# Runs as uid 10001 on a read-only root filesystem: only /tmp must be writable (a tmpfs).
# Built and run by tests/deploy/test_image_builds.py on a local Debian base (BASE, below).

# The base: by default the pinned 3.12.8 slim image on Debian bookworm (python:3.12-slim moves under
# you); any Debian-like root filesystem with python3 and its venv module will do (--build-arg BASE=...).
ARG BASE=python:3.12.8-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH


WORKDIR /src
# Only what building the package needs: pyproject.toml names README.md as its readme, and
# packages.find takes llamamesh*, services* and workers* (the generated *_pb2 code is checked in).
COPY pyproject.toml README.md ./
COPY requirements/lock.txt requirements/lock.txt
COPY llamamesh/ llamamesh/
COPY services/ services/
COPY workers/ workers/

# The same steps as `make install` without the cpu extra: pip from the lock first (it knows
# --build-constraint), then the package with every version, build backend included, from the lock.
# One stage, as the CPU worker's (worker-cpu.Dockerfile says why).
RUN python3 -m venv /opt/venv \
 && pip install -q --no-cache-dir -c requirements/lock.txt pip \
 && pip install -q --no-cache-dir -c requirements/lock.txt --build-constraint requirements/lock.txt . \
 && ! pip show torch >/dev/null 2>&1 \
 && rm -rf /src
WORKDIR /tmp

# A numeric uid, so runAsNonRoot can verify it; no home directory in the image: HOME is /tmp.
RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin llamamesh

ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    LLAMAMESH_GATEWAY_HOST=0.0.0.0 \
    LLAMAMESH_GATEWAY_PORT=50051 \
    LLAMAMESH_GATEWAY_HTTP_PORT=8000 \
    LLAMAMESH_GATEWAY_METRICS_PORT=9400

USER 10001:10001
# /tmp is the only path written (tempfile, the metrics folder of LLAMAMESH_GATEWAY_PROCESSES > 1):
# mount a tmpfs there when the root filesystem is read-only.
VOLUME ["/tmp"]
EXPOSE 50051 8000 9400

# Exec form: python is PID 1 and receives SIGTERM itself (health NOT_SERVING, settle, drain).
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "services"]

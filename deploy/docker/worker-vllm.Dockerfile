# syntax=docker/dockerfile:1
# The vLLM worker: llamamesh's base package on vLLM's own image, whose torch, CUDA libraries and
# vLLM build stay exactly as vLLM ships them.
#   docker build -f deploy/docker/worker-vllm.Dockerfile -t llamamesh-worker-vllm .   (context: repo root)
# Runs as uid 10001 on a read-only root filesystem: /tmp (a tmpfs) and /var/cache/llamamesh (a
# volume: Hugging Face, vLLM, Triton and torch.compile caches) must be writable, /dev/shm large
# (see deploy/compose/compose.yaml).
# NEVER BUILT: its base is vLLM's CUDA image, which the test machines cannot pull (no registry) or
# run (no GPU); it is checked only by hadolint and tests/deploy/test_images.py.

# Pinned: the vLLM release that workers/engines/vllm.py is written against (pyproject: vllm==0.26.0).
ARG BASE=vllm/vllm-openai:v0.26.0
FROM ${BASE}

# Build-time only: the image's Python is a system one (pip may refuse to install into it without this).
ARG PIP_BREAK_SYSTEM_PACKAGES=1
ARG PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/lock.txt requirements/lock.txt
COPY llamamesh/ llamamesh/
COPY services/ services/
COPY workers/ workers/

# Keeping vLLM's torch: the base package needs no torch, and every version pip might touch is
# pinned twice: first to what the image already has for vLLM's stack (torch, triton, xformers,
# flashinfer, vllm, the nvidia-* CUDA wheels: /tmp/vllm-stack.txt, taken from `pip freeze`), then
# to the lock like every other install here. Should any dependency ever pull torch in, the two pins
# disagree (the lock says torch==2.13.0, the CPU one) and the build fails instead of replacing
# vLLM's torch. The small shared dependencies (protobuf, grpcio, prometheus-client, opentelemetry)
# take the lock's versions, the ones llamamesh is tested with; `pip check` then fails the build if
# one of them breaks a requirement of vLLM's.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m pip freeze --all \
      | grep -iE '^(torch|torchvision|torchaudio|triton|xformers|flashinfer[a-z_-]*|vllm|nvidia-[a-z0-9_-]+)==' \
      > /tmp/vllm-stack.txt \
 && python3 -m pip install -q --no-cache-dir -c /tmp/vllm-stack.txt -c requirements/lock.txt pip \
 && python3 -m pip install -q --no-cache-dir -c /tmp/vllm-stack.txt -c requirements/lock.txt \
      --build-constraint requirements/lock.txt . \
 && python3 -m pip check \
 && python3 -c "import vllm, workers.engines.vllm" \
 && rm -rf /src/* /tmp/vllm-stack.txt

RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin llamamesh \
 && mkdir -p /var/cache/llamamesh \
 && chown 10001:10001 /var/cache/llamamesh

# Every cache vLLM and its libraries write goes to /var/cache/llamamesh (a volume: compiled
# kernels survive a restart) or /tmp; nothing is written under the read-only root. No usage
# statistics are sent home.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/var/cache/llamamesh/xdg \
    HF_HOME=/var/cache/llamamesh/hf \
    VLLM_CACHE_ROOT=/var/cache/llamamesh/vllm \
    VLLM_CONFIG_ROOT=/tmp/vllm-config \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    TRITON_CACHE_DIR=/var/cache/llamamesh/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/llamamesh/torchinductor \
    LLAMAMESH_WORKER_ENGINE=vllm \
    LLAMAMESH_WORKER_POOL=vllm \
    LLAMAMESH_WORKER_CACHE_DIR=/var/cache/llamamesh \
    LLAMAMESH_WORKER_METRICS_HOST=0.0.0.0 \
    LLAMAMESH_WORKER_METRICS_PORT=9401

USER 10001:10001
WORKDIR /tmp
VOLUME ["/var/cache/llamamesh", "/tmp"]
EXPOSE 9401

# Exec form replacing the image's `vllm serve`: python is PID 1 and receives SIGTERM itself.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python3", "-m", "workers"]

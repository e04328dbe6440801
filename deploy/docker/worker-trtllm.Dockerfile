# syntax=docker/dockerfile:1
# NEVER BUILT OR RUN. TensorRT-LLM cannot be installed on the machines this project is developed
# and tested on (no NGC registry access, no TensorRT-LLM wheel), so this file is checked only by
# hadolint and tests/deploy/test_images.py; workers/engines/trtllm.py is likewise untested against
# a real TensorRT-LLM. Treat the first build as the first test.
#
# The TensorRT-LLM worker: llamamesh's base package on NVIDIA's TensorRT-LLM release image, whose
# torch, CUDA, TensorRT and tensorrt_llm stay exactly as NVIDIA ships them.
#   docker build -f deploy/docker/worker-trtllm.Dockerfile -t llamamesh-worker-trtllm .   (context: repo root)
# Runs as uid 10001 on a read-only root filesystem: /tmp (a tmpfs) and /var/cache/llamamesh (a
# volume) must be writable, /dev/shm large (MPI and NCCL use it).

# Pinned release tag (TensorRT-LLM 1.2.0, the LLM API with the pytorch backend that the adapter
# uses); the tag was not checked against NGC from here.
ARG BASE=nvcr.io/nvidia/tensorrt-llm/release:1.2.0
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

# As in worker-vllm.Dockerfile: the image's own stack (torch, tensorrt, tensorrt_llm, the nvidia-*
# wheels; NGC images also keep theirs in PIP_CONSTRAINT) is pinned to what is installed, then the
# lock like every other install here; torch never changes (the two pins would disagree and the build
# fail) and `pip check` fails the build if a shared dependency broke one of TensorRT-LLM's.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m pip freeze --all \
      | grep -iE '^(torch|torchvision|torchaudio|triton|tensorrt[a-z_-]*|nvidia-[a-z0-9_-]+|flashinfer[a-z_-]*)==' \
      > /tmp/trtllm-stack.txt \
 && python3 -m pip install -q --no-cache-dir -c /tmp/trtllm-stack.txt -c requirements/lock.txt pip \
 && python3 -m pip install -q --no-cache-dir -c /tmp/trtllm-stack.txt -c requirements/lock.txt \
      --build-constraint requirements/lock.txt . \
 && python3 -m pip check \
 && python3 -c "import tensorrt_llm, workers.engines.trtllm" \
 && rm -rf /src/* /tmp/trtllm-stack.txt

RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin llamamesh \
 && mkdir -p /var/cache/llamamesh \
 && chown 10001:10001 /var/cache/llamamesh

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/var/cache/llamamesh/xdg \
    HF_HOME=/var/cache/llamamesh/hf \
    TRITON_CACHE_DIR=/var/cache/llamamesh/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/llamamesh/torchinductor \
    LLAMAMESH_WORKER_ENGINE=trtllm \
    LLAMAMESH_WORKER_POOL=trtllm \
    LLAMAMESH_WORKER_CACHE_DIR=/var/cache/llamamesh \
    LLAMAMESH_WORKER_METRICS_HOST=0.0.0.0 \
    LLAMAMESH_WORKER_METRICS_PORT=9401

USER 10001:10001
WORKDIR /tmp
VOLUME ["/var/cache/llamamesh", "/tmp"]
EXPOSE 9401

# Exec form: python is PID 1 and receives SIGTERM itself.
STOPSIGNAL SIGTERM
ENTRYPOINT ["python3", "-m", "workers"]

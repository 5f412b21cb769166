# Narwhal: `make demo` shows tokens streaming through the router; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

BENCH_VENV ?= .bench-venv
VLLM_DIR ?= $(HOME)/.cache/narwhal-vllm   # the real-engine environment, outside the tree

.PHONY: venv compiled demo fleet test test-lowest lint typecheck unit rough-bench bench bench-quick bench-placement bench-overload bench-replay e2e-vllm e2e-lb image image-test faults soak fuzz clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	NARWHAL_PURE=1 $(PY) -m pip install -q -e '.[dev]'
	touch $@

# the compiled build (setup.py's COMPILED, docs/build.md): the pure core, the stream code and
# the per-token path as C extensions beside their source, rebuilt when one of them changes;
# without a C compiler the tree stays pure Python. `narwhal --version` says which.
COMPILED_SOURCES := setup.py narwhal/router/token_path.py narwhal/router/stream_reactor.py \
	narwhal/lowlevel/fast_io.py $(wildcard narwhal/core/*.py narwhal/stream/*.py)
$(VENV)/.compiled: $(VENV)/.installed $(COMPILED_SOURCES)
	$(PY) setup.py -q build_ext --inplace --build-lib build/inplace
	$(PY) -m narwhal --version
	touch $@

compiled: $(VENV)/.compiled

venv: $(VENV)/.compiled

demo: venv           ## two fake engines + the router; stream one chat completion
	$(PY) -m narwhal demo --port 0

fleet: venv          ## the same, kept running on :8000 for curl
	$(PY) -m narwhal demo --keep --port 8000

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: venv
	$(PY) -m mypy

unit: venv
	$(PY) -m pytest -q

test: lint typecheck unit

LOWEST_VENV ?= .venv-lowest
# ... and the pure-Python build of the same tree (NARWHAL_PURE=1: the source, not the
# extensions `make compiled` put beside it)
test-lowest:         ## the fast tests against the lowest trio, hypercorn and h11 pyproject allows, pure Python
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install -q --upgrade pip
	NARWHAL_PURE=1 $(LOWEST_VENV)/bin/python -m pip install -q -c .ci/lowest.txt -e '.[dev]'
	NARWHAL_PURE=1 $(LOWEST_VENV)/bin/python -m narwhal --version
	NARWHAL_PURE=1 $(LOWEST_VENV)/bin/python -m pytest -q tests/unit tests/shell fuzz

rough-bench: venv    ## first rough figure: 1,000 streamed 64-token requests at c=32
	$(PY) bench/rough.py --requests 1000 --concurrency 32 --tokens 64

$(BENCH_VENV)/.installed:   ## the peers we measure against: instruments, never imported by narwhal/
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q vllm-router==0.1.17 narwhal-inference==0.7.0 matplotlib aiohttp uvloop
	touch $@

bench-quick: venv $(BENCH_VENV)/.installed   ## all four targets, scenarios a and b, under 3 minutes
	$(PY) bench/peers.py --quick --peers-venv $(BENCH_VENV)

BASELINE ?=   # a checkout of today's main: `make bench BASELINE=../main` adds it as narwhal-main, A/B
ROUNDS ?=
ENGINES ?= fast   # fast: bench/fast_engine.py (aiohttp on uvloop); fake: narwhal fake-engine
bench: venv $(BENCH_VENV)/.installed         ## all scenarios, table and plot in bench/results/
	$(PY) bench/peers.py --peers-venv $(BENCH_VENV) --engines $(strip $(ENGINES)) $(if $(strip $(BASELINE)),--baseline $(strip $(BASELINE))) $(if $(strip $(ROUNDS)),--rounds $(strip $(ROUNDS)))

ONLY ?=   # a workload name's start: `make bench-placement ONLY=lora` runs the lora adapters one (~2 min)
bench-placement: venv $(BENCH_VENV)/.installed   ## placement policies and conditional disaggregation vs the peers, 7 workloads (~37 min)
	$(PY) bench/placement.py --peers-venv $(BENCH_VENV) $(if $(strip $(ONLY)),--only "$(strip $(ONLY))")

bench-overload: venv $(BENCH_VENV)/.installed   ## flow control at 2x capacity vs no queue and the peers (~10 min)
	$(PY) bench/overload.py --peers-venv $(BENCH_VENV)

REPLAY ?=   # more options: `make bench-replay REPLAY='--variant "queue_off:admission.queue=false"'`
bench-replay: venv $(BENCH_VENV)/.installed   ## 3 min of Mooncake's conversation trace at 4x, loads 0.6 and 0.9, every router (~10 min)
	$(PY) bench/replay_trace.py --peers-venv $(BENCH_VENV) $(REPLAY)

IMAGE ?= localhost/narwhal:$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# the router's image (deploy/Containerfile) with buildah on a Debian base that mmdebstrap
# makes, cached in ~/.cache/narwhal-image; prints the build time and the image size
image:
	bash deploy/image_build.sh $(IMAGE)

image-test: image    ## the image on loopback: compiled build, a stream through it, health check, uid, drain
	$(PYTHON) deploy/image_test.py --image $(IMAGE)

faults: venv         ## the fault matrix: every scenario, 200 requests at c=32, as a table
	$(PY) -m tests.matrix.fault_matrix --requests 200 --concurrency 32

fuzz: venv           ## the property tests (SSE splits, stream models) at 10x their CI example count
	NARWHAL_FUZZ_SCALE=10 $(PY) -m pytest -q -p no:cacheprovider fuzz

soak: venv           ## 20,000 requests at c=64 with 5% mixed engine faults: RSS, descriptors, tasks
	$(PY) bench/soak.py --requests 20000 --concurrency 64

e2e-vllm: venv       ## our router between two real vLLM engines moving real KV (3.7 GB, minutes)
	bash e2e/vllm/setup.sh $(VLLM_DIR)
	NARWHAL_VLLM_DIR=$(VLLM_DIR) $(PY) -m pytest -m vllm -p no:cacheprovider -s e2e/vllm

e2e-lb: venv         ## two router replicas behind HAProxy: rolling restart and a SIGKILL under load
	command -v haproxy >/dev/null || (apt-get update -qq && apt-get install -y -qq haproxy)
	$(PY) -m pytest -m lb -p no:cacheprovider -s e2e/lb

clean:
	rm -rf $(VENV) $(LOWEST_VENV) $(BENCH_VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis build
	find narwhal -name '*.so' -delete

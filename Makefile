# Set-up and entry points. `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench venv vllm-env clean

venv: $(STAMP)

# torch is pinned for the dev environment (a CPU wheel of it is on the build machines' disk);
# the package itself accepts a range.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# A separate environment with vLLM, for the connector's conformance test (vLLM is not a
# dependency of tierd). vLLM's wheel goes in without its dependencies (they would replace the
# pinned CPU torch); the pure-Python packages its connector API imports are added by name.
VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.33.0
VLLM_DEPS := packaging psutil pyzmq urllib3 regex numpy 'transformers>=5.16.1,<5.21' cbor2 aiohttp \
	requests openai-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo \
	prometheus-client 'xgrammar==0.2.8' fastapi partial-json-parser llguidance

vllm-env: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet --no-deps vllm==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM_DEPS)
	$(VLLM_VENV)/bin/pip install --quiet -e .
	touch $@

run: $(STAMP)
	$(PY) -m tierd.demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) -m benchmarks.tiers --quick
	$(PY) -m benchmarks.daemon --quick
	$(PY) -m benchmarks.kv_waste --quick
	$(PY) -m benchmarks.engine_throughput --quick
	$(PY) -m benchmarks.ttft --quick
	$(PY) -m benchmarks.load --quick
	$(PY) -m benchmarks.recovery --quick
	$(PY) -m benchmarks.engine_faults --quick
	$(PY) -m benchmarks.gpu_kernels --quick

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache

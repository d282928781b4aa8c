# Set-up and entry points. `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench venv clean

venv: $(STAMP)

# torch is pinned for the dev environment (a CPU wheel of it is on the build machines' disk);
# the package itself accepts a range.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

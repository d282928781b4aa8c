# An engine image with tierd installed beside the engine (the connector runs in the engine's
# processes): the engine's own image plus `pip install tierd` from this checkout. Build from the
# repository root with the engine image you run, e.g.
#   docker build -f deploy/engine.Dockerfile --build-arg ENGINE_IMAGE=<your vLLM image> -t REGISTRY/tierd-vllm:0.1.0 .
#   docker build -f deploy/engine.Dockerfile --build-arg ENGINE_IMAGE=<your SGLang image> -t REGISTRY/tierd-sglang:0.1.0 .
# (tested engine versions: docs/vllm.md, docs/sglang.md). pip keeps the engine's own numpy
# and other packages where they already satisfy tierd's ranges. An engine image whose Python is
# marked externally managed needs its own venv's pip here (or --break-system-packages).
ARG ENGINE_IMAGE
# checkov:skip=CKV_DOCKER_7: the base is the engine image the operator names (a required build argument)
FROM ${ENGINE_IMAGE}
USER 0
COPY pyproject.toml README.md /tmp/tierd-src/
COPY tierd /tmp/tierd-src/tierd
COPY connectors /tmp/tierd-src/connectors
COPY kernels /tmp/tierd-src/kernels
RUN python3 -m pip install --no-cache-dir /tmp/tierd-src \
    && rm -rf /tmp/tierd-src \
    && python3 -c "import tierd.connectors" \
    && (getent group 10001 >/dev/null || groupadd --gid 10001 tierd) \
    && (getent passwd 10002 >/dev/null || useradd --uid 10002 --user-group --groups 10001 \
        --home-dir /home/engine --no-create-home --shell /usr/sbin/nologin engine)
# the pods run as uid 10002 with supplementary group 10001 (the daemon's peers)
USER 10002
# Kubernetes probes the engine's HTTP /health (deploy/kubernetes/overlays)
HEALTHCHECK NONE

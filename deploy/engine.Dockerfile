# An engine image with tierd installed beside the engine (the connector runs in the engine's
# processes): the engine's own image plus the wheel `make wheel` builds from this checkout (no
# tierd is published on a package index yet). Build from the repository root, after `make wheel`,
# with the engine image you run, e.g.
#   docker build -f deploy/engine.Dockerfile --build-arg ENGINE_IMAGE=<your vLLM image> -t REGISTRY/tierd-vllm:COMMIT .
#   docker build -f deploy/engine.Dockerfile --build-arg ENGINE_IMAGE=<your SGLang image> -t REGISTRY/tierd-sglang:COMMIT .
# (tested engine versions: docs/vllm.md, docs/sglang.md). The engine's own packages are never
# changed: pip installs tierd under a constraints file of everything the image already has, so a
# dependency range of tierd's that the engine's versions do not meet fails the build (with pip's
# reason) instead of upgrading the engine's numpy or torch. An engine image whose Python is marked
# externally managed needs its own venv's pip here (or --break-system-packages).
ARG ENGINE_IMAGE
# checkov:skip=CKV_DOCKER_7: the base is the engine image the operator names (a required build argument)
FROM ${ENGINE_IMAGE}
USER 0
COPY dist/ /tmp/tierd-dist/
RUN python3 -m pip freeze --all > /tmp/engine-constraints.txt \
    && python3 -m pip install --no-cache-dir -c /tmp/engine-constraints.txt /tmp/tierd-dist/tierd-*-py3-none-any.whl \
    && rm -rf /tmp/tierd-dist /tmp/engine-constraints.txt \
    && python3 -c "import tierd.connectors" \
    && (getent group 10001 >/dev/null || groupadd --gid 10001 tierd) \
    && (getent passwd 10002 >/dev/null || useradd --uid 10002 --user-group --groups 10001 \
        --home-dir /home/engine --no-create-home --shell /usr/sbin/nologin engine)
# the pods run as uid 10002 with supplementary group 10001 (the daemon's peers)
USER 10002
# Kubernetes probes the engine's HTTP /health (deploy/kubernetes/overlays)
HEALTHCHECK NONE

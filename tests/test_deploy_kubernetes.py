"""deploy/kubernetes: the Kustomize base and overlays render, validate and keep the node contract.

Tools come from `.venv-deploy` (`make deploy-env`): kubectl (its built-in kustomize renders every
overlay), kubernetes-validate (the API's JSON schemas, strict: an unknown field is an error) and
checkov (security policies). Without that environment these tests skip, or fail where it is part
of the suite (TEST_REQUIRE_DEPLOY=1, as in CI).

The contract checks (`contract_problems`) hold what engine pods and other tests rely on: the host
paths, uids and groups, the hardening, the probes, the preStop sync and the memory limit that
counts the host arena. Each check is also run against broken copies of the manifests
(`MUTANTS`), so a check that could not fail would be caught here too.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUSTOMIZE_ROOT = DEPLOY / "kubernetes"
VENV = ROOT / ".venv-deploy"
KUBECTL = VENV / "bin" / "kubectl"
DEPLOY_PY = VENV / "bin" / "python"
CHECKOV = VENV / "bin" / "checkov"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "engine.Dockerfile"]

# -- the node contract ------------------------------------------------------------------------
NAMESPACE = "tierd-system"
SOCKET_DIR = "/run/tierd"
SOCKET = "/run/tierd/tierd.sock"
ARENA_DIR = "/dev/shm/tierd"
DISK_DIR = "/var/lib/tierd"
DISK_PATH = "/var/lib/tierd/disk"
DAEMON_UID = DAEMON_GID = 10001
CONFIG = "/etc/tierd/tierd.toml"
SERVE = ["tierd", "serve", "--config", CONFIG]
PING = ["tierd", "ping", "--socket", SOCKET]
SYNC = ["tierd", "sync", "--socket", SOCKET]
METRICS_PORT = 9464
# capabilities the one root init container may add to hand the host directories to the daemon
INIT_CAPS = {"CHOWN", "FOWNER", "DAC_OVERRIDE"}
GIB = 1 << 30
# CRD groups with no schema in kubernetes-validate: checked structurally below
CRD_GROUPS = {"monitoring.coreos.com"}


def require_deploy_env() -> None:
    if not (VENV / ".installed").exists():
        if os.environ.get("TEST_REQUIRE_DEPLOY"):
            pytest.fail("the deploy environment .venv-deploy is part of this suite here, and it is missing "
                        "(`make deploy-env` builds it)")
        pytest.skip("no .venv-deploy environment (kubectl, kubernetes-validate, checkov); `make deploy-env` builds it")


def load_yaml_all(text: str) -> list:
    """Every document of a YAML stream: with PyYAML where this Python has it, else through the
    deploy environment's Python (which always has it)."""
    try:
        import yaml
    except ImportError:
        r = subprocess.run([str(DEPLOY_PY), "-c", "import json, sys, yaml; "
                            "print(json.dumps(list(yaml.safe_load_all(sys.stdin))))"],
                           input=text, capture_output=True, text=True, check=True)
        docs = json.loads(r.stdout)
    else:
        docs = list(yaml.safe_load_all(text))
    return [d for d in docs if d is not None]


def dump_yaml_all(docs: list) -> str:
    """A YAML stream of `docs` (JSON is YAML; one document per object)."""
    return "".join("---\n" + json.dumps(d, indent=1) + "\n" for d in docs)


def kustomizations() -> dict[str, Path]:
    """Every kustomization under deploy/kubernetes, by its path there: {name: dir}."""
    return {str(p.parent.relative_to(KUSTOMIZE_ROOT)): p.parent
            for p in sorted(KUSTOMIZE_ROOT.rglob("kustomization.yaml"))}


def buildable() -> dict[str, Path]:
    """The kustomizations `kubectl kustomize` builds (components are built through overlays)."""
    out = {}
    for name, d in kustomizations().items():
        kind = load_yaml_all((d / "kustomization.yaml").read_text())[0].get("kind", "Kustomization")
        if kind != "Component":
            out[name] = d
    return out


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    require_deploy_env()
    out = {}
    for name, d in buildable().items():
        r = subprocess.run([str(KUBECTL), "kustomize", str(d)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"kubectl kustomize {d.relative_to(ROOT)} failed:\n{r.stderr}"
        out[name] = load_yaml_all(r.stdout)
    return out


# -- reading the rendered objects ---------------------------------------------------------------

def objects(objs, kind, name=None):
    return [o for o in objs if o.get("kind") == kind and (name is None or o["metadata"]["name"] == name)]


def workloads(objs):
    """(object, pod spec) of every workload."""
    return [(o, o["spec"]["template"]["spec"]) for o in objs
            if o.get("kind") in ("DaemonSet", "Deployment", "StatefulSet", "Job")]


def daemon_of(objs):
    ds = objects(objs, "DaemonSet", "tierd")
    return ds[0] if len(ds) == 1 else None


def engines_of(objs):
    return [(o, spec) for o, spec in workloads(objs) if o.get("kind") != "DaemonSet"]


def host_mounts(pod, container) -> dict[str, tuple[str, str]]:
    """{mountPath: (hostPath, type)} of a container's hostPath mounts."""
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    out = {}
    for m in container.get("volumeMounts", []):
        hp = vols.get(m["name"], {}).get("hostPath")
        if hp is not None:
            out[m["mountPath"]] = (hp["path"], hp.get("type", ""))
    return out


def quantity(q) -> float:
    """A Kubernetes quantity ("18Gi", "500M", "1", "250m") in base units."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(q))
    assert m, f"not a quantity: {q!r}"
    mult = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
            "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50}[m.group(2)]
    return float(m.group(1)) * mult


def flag(args: list[str], name: str):
    """The value of `--name V` or `--name=V` in an argument list (None: absent)."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1:]
    return None


def serve_config(objs):
    """(ConfigMap, ServeConfig) of the daemon's mounted tierd.toml, or a problem string."""
    from tierd.config import ConfigError, load_serve_config
    ds = daemon_of(objs)
    pod = ds["spec"]["template"]["spec"]
    c = next((c for c in pod["containers"] if c["name"] == "tierd"), None)
    mount = next((m for m in (c or {}).get("volumeMounts", []) if m["mountPath"] == os.path.dirname(CONFIG)), None)
    if mount is None:
        return None, f"no volume mounted at {os.path.dirname(CONFIG)}"
    vol = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm_name = vol.get("configMap", {}).get("name")
    cms = objects(objs, "ConfigMap", cm_name)
    if not cms:
        return None, f"the config volume names ConfigMap {cm_name!r}, which is not rendered"
    text = cms[0].get("data", {}).get(os.path.basename(CONFIG))
    if text is None:
        return cms[0], f"ConfigMap {cm_name} has no key {os.path.basename(CONFIG)}"
    try:
        return cms[0], load_serve_config(CONFIG, data=text.encode(), env={})
    except ConfigError as e:
        return cms[0], f"tierd.toml is refused by tierd: {e}"


# -- the contract -------------------------------------------------------------------------------

def pod_security_problems(where: str, pod: dict) -> list[str]:
    """Hardening every pod (daemon and engines) keeps."""
    p = []
    for k in ("hostNetwork", "hostIPC", "hostPID"):
        if pod.get(k):
            p.append(f"{where}: {k} is set")
    psc = pod.get("securityContext", {})
    if psc.get("runAsNonRoot") is not True:
        p.append(f"{where}: pod securityContext.runAsNonRoot is not true")
    if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        p.append(f"{where}: pod seccompProfile is not RuntimeDefault")
    if pod.get("automountServiceAccountToken") is not False:
        p.append(f"{where}: automountServiceAccountToken is not false")
    for kind in ("initContainers", "containers"):
        for c in pod.get(kind, []):
            w = f"{where} {kind[:-1]} {c['name']}"
            sc = c.get("securityContext", {})
            uid = sc.get("runAsUser", psc.get("runAsUser"))
            caps = sc.get("capabilities", {})
            if sc.get("privileged"):
                p.append(f"{w}: privileged")
            if sc.get("allowPrivilegeEscalation") is not False:
                p.append(f"{w}: allowPrivilegeEscalation is not false")
            if sc.get("readOnlyRootFilesystem") is not True:
                p.append(f"{w}: readOnlyRootFilesystem is not true")
            if "ALL" not in caps.get("drop", []):
                p.append(f"{w}: capabilities do not drop ALL")
            if sc.get("seccompProfile", {}).get("type", "RuntimeDefault") != "RuntimeDefault":
                p.append(f"{w}: seccompProfile is not RuntimeDefault")
            if uid is None:
                p.append(f"{w}: no runAsUser")
            elif uid == 0:
                # only an init container may be root, and only to chown/chmod the host directories
                if kind != "initContainers":
                    p.append(f"{w}: runs as root")
                elif not set(caps.get("add", [])) <= INIT_CAPS:
                    p.append(f"{w}: root init container adds {sorted(set(caps.get('add', [])) - INIT_CAPS)}")
            else:
                if caps.get("add"):
                    p.append(f"{w}: adds capabilities {caps['add']}")
                if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
                    p.append(f"{w}: runAsNonRoot is not true")
    return p


def daemon_problems(objs) -> list[str]:
    from tierd.config import parse_size
    from tierd.server import Daemon
    p = []
    if not objects(objs, "Namespace", NAMESPACE):
        p.append(f"no Namespace {NAMESPACE}")
    ds = daemon_of(objs)
    if ds is None:
        return p + ["not exactly one DaemonSet named tierd"]
    if ds["metadata"].get("namespace") != NAMESPACE:
        p.append(f"DaemonSet tierd is not in {NAMESPACE}")
    pod = ds["spec"]["template"]["spec"]
    p += pod_security_problems("DaemonSet tierd", pod)
    sa = objects(objs, "ServiceAccount", pod.get("serviceAccountName", "default"))
    if not sa or sa[0].get("automountServiceAccountToken") is not False:
        p.append("the daemon's ServiceAccount is not rendered with automountServiceAccountToken: false")
    psc = pod.get("securityContext", {})
    if (psc.get("runAsUser"), psc.get("runAsGroup")) != (DAEMON_UID, DAEMON_GID):
        p.append(f"daemon pod does not run as {DAEMON_UID}:{DAEMON_GID}")
    strategy = ds["spec"].get("updateStrategy", {})
    if strategy.get("type") != "RollingUpdate" or strategy.get("rollingUpdate", {}).get("maxUnavailable") != 1 \
            or strategy.get("rollingUpdate", {}).get("maxSurge", 0) != 0:
        p.append("updateStrategy is not RollingUpdate, maxUnavailable 1, maxSurge 0")
    if not pod.get("nodeSelector") and not pod.get("affinity", {}).get("nodeAffinity"):
        p.append("the DaemonSet selects no nodes (nodeSelector or nodeAffinity)")
    daemons = [c for c in pod["containers"] if c.get("command") == SERVE]
    if len(daemons) != 1:
        return p + [f"not exactly one container runs {' '.join(SERVE)}"]
    c = daemons[0]
    sc = c.get("securityContext", {})
    if (sc.get("runAsUser", psc.get("runAsUser")), sc.get("runAsGroup", psc.get("runAsGroup"))) \
            != (DAEMON_UID, DAEMON_GID):
        p.append(f"daemon container does not run as {DAEMON_UID}:{DAEMON_GID}")
    # scheduled ahead of ordinary pods (a Pending daemon keeps every engine off its node), and
    # never CPU-throttled on the engines' critical path
    prio = pod.get("priorityClassName")
    pcs = objects(objs, "PriorityClass", prio) if prio else []
    if not pcs or pcs[0].get("value", 0) < 1000000 or pcs[0].get("globalDefault"):
        p.append(f"daemon: priorityClassName {prio!r} names no high, non-default PriorityClass rendered with it")
    if "cpu" in c.get("resources", {}).get("limits", {}):
        p.append("daemon: a CPU limit (CFS throttling stalls loads and stores)")
    # host paths: each at the same path in the pod as on the node, nothing else of the host
    mounts = host_mounts(pod, c)
    want = {SOCKET_DIR: SOCKET_DIR, ARENA_DIR: ARENA_DIR, DISK_DIR: DISK_DIR}
    for mp, hp in want.items():
        if mounts.get(mp, ("",))[0] != hp:
            p.append(f"daemon: hostPath {hp} is not mounted at {mp}")
    if mounts.get(SOCKET_DIR, ("", ""))[1] != "DirectoryOrCreate":
        p.append(f"daemon: hostPath {SOCKET_DIR} is not of type DirectoryOrCreate")
    if mounts.get(DISK_DIR, ("", ""))[1] != "Directory":
        p.append(f"daemon: hostPath {DISK_DIR} is not of type Directory (the node's own mount, never made on "
                 "the root disk by the kubelet)")
    for mp, (hp, _) in mounts.items():
        if hp not in want.values():
            p.append(f"daemon: unexpected hostPath {hp} at {mp}")
    for init in pod.get("initContainers", []):
        for mp, (hp, _) in host_mounts(pod, init).items():
            if hp not in want.values() or mp != hp:
                p.append(f"init container {init['name']}: hostPath {hp} at {mp}")
    # probes and the stop
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        if c.get(probe, {}).get("exec", {}).get("command") != PING:
            p.append(f"{probe} does not run {' '.join(PING)}")
    st = c.get("startupProbe", {})
    if st.get("periodSeconds", 10) * st.get("failureThreshold", 3) < 300:
        p.append("startupProbe allows less than 5 minutes for re-adopting the host tier")
    if c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command") != SYNC:
        p.append(f"preStop does not run {' '.join(SYNC)}")
    # the config the daemon reads
    cm, cfg = serve_config(objs)
    if isinstance(cfg, str):
        return p + [cfg]
    # the grace period covers preStop's `tierd sync` (a minute at least), then the stop's request
    # drain and its own sync, which the config bounds (sync_on_stop_s)
    if pod.get("terminationGracePeriodSeconds", 30) < 60 + Daemon.STOP_REQUESTS_S + cfg.sync_on_stop_s:
        p.append("terminationGracePeriodSeconds leaves no room for preStop's sync and the stop's own "
                 f"(sync_on_stop_s {cfg.sync_on_stop_s:.0f} s)")
    if not re.fullmatch(r"tierd-config-[a-z0-9]{6,}", cm["metadata"]["name"]):
        p.append(f"ConfigMap {cm['metadata']['name']} is not generated (no content hash): "
                 "edits would not roll the pods")
    expect = {"socket": SOCKET, "socket_mode": 0o660, "arena_dir": ARENA_DIR, "sync_on_stop": True}
    for k, v in expect.items():
        if getattr(cfg, k) != v:
            p.append(f"tierd.toml: {k} = {getattr(cfg, k)!r}, not {v!r}")
    if cfg.store.disk_path != DISK_PATH:
        p.append(f"tierd.toml: [disk] path = {cfg.store.disk_path!r}, not {DISK_PATH!r}")
    if DAEMON_GID not in cfg.allowed_gids:
        p.append(f"tierd.toml: allowed_gids lacks {DAEMON_GID}, the engines' group")
    if not cfg.store.host_keep:
        p.append("tierd.toml: [host] keep is off: a rolling restart would drop the host tier")
    host, _, port = cfg.metrics_addr.rpartition(":")
    ports = {pp.get("name"): pp.get("containerPort") for pp in c.get("ports", [])}
    if host not in ("0.0.0.0", "[::]") or ports.get("metrics") != int(port or 0):
        p.append(f"metrics_addr {cfg.metrics_addr!r} is not served on the containerPort named metrics")
    # memory: the limit counts the host arena (tmpfs pages charged to this pod)
    if "%" in str(cfg.store.host_bytes):
        p.append("tierd.toml: [host] bytes is a share of the node's RAM: no memory limit can be checked against it")
    else:
        host_bytes = parse_size(cfg.store.host_bytes)
        res = c.get("resources", {})
        lim = quantity(res.get("limits", {}).get("memory", 0))
        need = host_bytes + host_bytes // 32 + GIB
        if lim < need:
            p.append(f"memory limit {lim / GIB:.2f} GiB is below the host arena ({host_bytes / GIB:.2f} GiB) "
                     f"plus its records and the process ({need / GIB:.2f} GiB)")
        if quantity(res.get("requests", {}).get("memory", 0)) != lim:
            p.append("memory request differs from the limit")
    # the scrape target
    svc = objects(objs, "Service", "tierd")
    labels = ds["spec"]["template"]["metadata"].get("labels", {})
    if not svc:
        p.append("no Service tierd (the scrape job)")
    else:
        s = svc[0]
        sel = s["spec"].get("selector", {})
        if not sel or any(labels.get(k) != v for k, v in sel.items()):
            p.append("Service tierd does not select the DaemonSet's pods")
        sp = [x for x in s["spec"].get("ports", []) if x.get("name") == "metrics"]
        if not sp or sp[0].get("targetPort") not in ("metrics", METRICS_PORT):
            p.append("Service tierd has no port metrics targeting the daemon's metrics port")
        ann = s["metadata"].get("annotations", {})
        if ann.get("prometheus.io/scrape") != "true" or ann.get("prometheus.io/port") != str(METRICS_PORT):
            p.append("Service tierd lacks prometheus.io/scrape and prometheus.io/port annotations")
        # a daemon failing its readiness probe stays a target: TierdDown (up == 0) can fire
        if s["spec"].get("publishNotReadyAddresses") is not True:
            p.append("Service tierd drops not-ready pods from the scrape targets (publishNotReadyAddresses)")
    # the metrics name models and fingerprints: only the monitoring namespace's pods may scrape
    p += metrics_policy_problems(objs)
    return p


def metrics_policy_problems(objs) -> list[str]:
    """NetworkPolicy tierd selects the daemon's pods and admits, to the metrics port only, the pods
    of named namespaces (a namespaceSelector on kubernetes.io/metadata.name), nothing else."""
    pol = objects(objs, "NetworkPolicy", "tierd")
    ds = daemon_of(objs)
    labels = ds["spec"]["template"]["metadata"].get("labels", {}) if ds else {}
    if not pol:
        return ["no NetworkPolicy tierd"]
    spec = pol[0]["spec"]
    p = []
    sel = spec.get("podSelector", {}).get("matchLabels", {})
    if not sel or any(labels.get(k) != v for k, v in sel.items()):
        p.append("NetworkPolicy tierd does not select the daemon's pods")
    if "Ingress" not in spec.get("policyTypes", []) or not spec.get("ingress"):
        p.append("NetworkPolicy tierd does not restrict ingress")
    for rule in spec.get("ingress", []):
        if [x.get("port") for x in rule.get("ports", [])] not in (["metrics"], [METRICS_PORT]):
            p.append(f"NetworkPolicy tierd admits more than the metrics port: {rule.get('ports')}")
        peers = rule.get("from") or [{}]
        for peer in peers:
            ns = peer.get("namespaceSelector", {})
            if set(peer) != {"namespaceSelector"} or set(ns) != {"matchLabels"} \
                    or set(ns["matchLabels"]) != {"kubernetes.io/metadata.name"}:
                p.append(f"NetworkPolicy tierd admits more than named namespaces to the metrics: {peer}")
    return p


def engine_problems(objs) -> list[str]:
    """Engines on the same node as a daemon, connected to it through the contract's paths."""
    p = []
    ds = daemon_of(objs)
    dpod = ds["spec"]["template"]["spec"] if ds else {}
    dlabels = ds["spec"]["template"]["metadata"].get("labels", {}) if ds else {}
    engines = engines_of(objs)
    if not engines:
        return ["no engine workload"]
    for o, pod in engines:
        where = f"{o['kind']} {o['metadata']['name']}"
        p += pod_security_problems(where, pod)
        # a namespace of the overlay's own: labelling an existing one privileged would lower
        # the Pod Security level of every pod already in it
        ens = o["metadata"].get("namespace")
        if ens in (None, "default", NAMESPACE, "kube-system") or not objects(objs, "Namespace", ens):
            p.append(f"{where}: in namespace {ens!r}, not one the overlay makes for its engines")
        psc = pod.get("securityContext", {})
        if DAEMON_GID not in psc.get("supplementalGroups", []):
            p.append(f"{where}: supplementalGroups lacks {DAEMON_GID}")
        if pod.get("nodeSelector") != dpod.get("nodeSelector"):
            p.append(f"{where}: nodeSelector differs from the DaemonSet's")
        terms = pod.get("affinity", {}).get("podAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
        if not any(t.get("topologyKey") == "kubernetes.io/hostname" and NAMESPACE in t.get("namespaces", [])
                   and t.get("labelSelector", {}).get("matchLabels", {}).items() <= dlabels.items()
                   and t.get("labelSelector", {}).get("matchLabels") for t in terms):
            p.append(f"{where}: no required podAffinity to a tierd pod on the same node")
        for c in pod["containers"]:
            sc = c.get("securityContext", {})
            uid = sc.get("runAsUser", psc.get("runAsUser"))
            if uid in (0, DAEMON_UID):
                p.append(f"{where}: engine runs as uid {uid} (the daemon's peers are others, by group)")
            mounts = host_mounts(pod, c)
            if mounts.get(SOCKET_DIR) != (SOCKET_DIR, "DirectoryOrCreate"):
                p.append(f"{where}: hostPath {SOCKET_DIR} (DirectoryOrCreate) is not mounted at {SOCKET_DIR}")
            if mounts.get(ARENA_DIR, ("",))[0] != ARENA_DIR:
                p.append(f"{where}: hostPath {ARENA_DIR} is not mounted at {ARENA_DIR}")
            for mp, (hp, _) in mounts.items():
                if hp.rstrip("/") in (DISK_DIR, "/var/lib", "/", "/run", "/dev/shm") or hp.startswith(DISK_DIR + "/"):
                    p.append(f"{where}: mounts host {hp} (the daemon's alone, or too wide)")
            if quantity(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0)) < 1:
                p.append(f"{where}: no nvidia.com/gpu limit")
            p += connector_problems(where, c.get("command", []) + c.get("args", []))
    return p


def docs_json(doc: str, option: str) -> dict | None:
    """The JSON object given to `option` in the first example of docs/DOC."""
    m = re.search(re.escape(option) + r"\s+'(\{.*?\})'", (ROOT / "docs" / doc).read_text(), re.S)
    return json.loads(m.group(1)) if m else None


def connector_problems(where: str, argv: list[str]) -> list[str]:
    import importlib
    url = f"unix://{SOCKET}"
    kv = flag(argv, "--kv-transfer-config")
    hicache = flag(argv, "--hicache-storage-backend-extra-config")
    if kv is None and hicache is None:
        return [f"{where}: no tierd connector configured (--kv-transfer-config or HiCache storage backend)"]
    p = []
    if kv is not None:
        cfg = json.loads(kv)
        want = {"kv_connector": "TierdConnector", "kv_connector_module_path": "tierd.connectors.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
        for k, v in want.items():
            if cfg.get(k) != v:
                p.append(f"{where}: kv-transfer-config {k} = {cfg.get(k)!r}, not {v!r}")
        if cfg.get("kv_connector_extra_config", {}).get("url") != url:
            p.append(f"{where}: the vLLM connector's url is not {url}")
        if cfg != docs_json("vllm.md", "--kv-transfer-config"):
            p.append(f"{where}: kv-transfer-config differs from docs/vllm.md's set-up")
        module, cls = cfg.get("kv_connector_module_path", ""), cfg.get("kv_connector", "")
    else:
        cfg = json.loads(hicache)
        if flag(argv, "--hicache-storage-backend") != "dynamic" or "--enable-hierarchical-cache" not in argv:
            p.append(f"{where}: SGLang's hierarchical cache with the dynamic storage backend is not on")
        want = {"backend_name": "tierd", "module_path": "tierd.connectors.sglang", "class_name": "TierdStorage",
                "interface_v1": 1, "url": url}
        for k, v in want.items():
            if cfg.get(k) != v:
                p.append(f"{where}: hicache extra config {k} = {cfg.get(k)!r}, not {v!r}")
        if cfg != docs_json("sglang.md", "--hicache-storage-backend-extra-config"):
            p.append(f"{where}: the HiCache extra config differs from docs/sglang.md's set-up")
        module, cls = cfg.get("module_path", ""), cfg.get("class_name", "")
    try:
        if not hasattr(importlib.import_module(module), cls):
            p.append(f"{where}: {module} has no {cls}")
    except ImportError as e:
        p.append(f"{where}: cannot import {module}: {e}")
    return p


def contract_problems(target: str, objs) -> list[str]:
    p = daemon_problems(objs)
    if target.startswith("overlays/") and target != "overlays/monitoring":
        p += engine_problems(objs)
    return p


# -- tests --------------------------------------------------------------------------------------

def test_every_kustomization_renders(rendered):
    names = set(rendered)
    assert "base" in names and {"overlays/vllm", "overlays/sglang"} <= names, names
    for name, objs in rendered.items():
        assert objs, f"{name} renders nothing"
    # every component is built through some overlay, so every object below is rendered and checked
    for name, d in kustomizations().items():
        if name not in rendered:
            users = [o for o in rendered
                     if any((KUSTOMIZE_ROOT / o / c).resolve() == d.resolve()
                            for c in load_yaml_all((KUSTOMIZE_ROOT / o / "kustomization.yaml").read_text())[0]
                            .get("components", []))]
            assert users, f"component {name} is used by no overlay here, so nothing renders it"


def test_images_are_set_by_kustomize(rendered):
    base = load_yaml_all((KUSTOMIZE_ROOT / "base" / "kustomization.yaml").read_text())[0]
    assert any(i["name"] == "tierd" and i.get("newTag") for i in base.get("images", [])), base.get("images")
    for name, objs in rendered.items():
        for o, pod in workloads(objs):
            for c in pod.get("initContainers", []) + pod["containers"]:
                assert ":" in c["image"] or "@" in c["image"], f"{name}: {c['name']} image {c['image']} has no tag"


def test_contract(rendered):
    problems = {name: contract_problems(name, objs) for name, objs in rendered.items()}
    assert not any(problems.values()), json.dumps(problems, indent=1)


def _m(target, what, fn):
    return pytest.param(target, fn, id=what)


def _daemon(objs):
    return daemon_of(objs)["spec"]["template"]["spec"]


def _daemon_c(objs):
    return next(c for c in _daemon(objs)["containers"] if c["name"] == "tierd")


def _engine(objs):
    return engines_of(objs)[0][1]


def _engine_obj(objs):
    return engines_of(objs)[0][0]


def _vol(pod, path):
    return next(v for v in pod["volumes"] if v.get("hostPath", {}).get("path") == path)


def _toml(objs, old, new):
    cm = objects(objs, "ConfigMap")[0]
    assert old in cm["data"]["tierd.toml"]
    cm["data"]["tierd.toml"] = cm["data"]["tierd.toml"].replace(old, new)


def _mount(c, path):
    return next(m for m in c["volumeMounts"] if m["mountPath"] == path)


MUTANTS = [
    _m("base", "socket-hostpath", lambda o: _vol(_daemon(o), SOCKET_DIR)["hostPath"].update(path="/run/other")),
    _m("base", "socket-hostpath-type", lambda o: _vol(_daemon(o), SOCKET_DIR)["hostPath"].update(type="Directory")),
    _m("base", "arena-mountpath", lambda o: _mount(_daemon_c(o), ARENA_DIR).update(mountPath="/dev/shm")),
    _m("base", "disk-hostpath", lambda o: _vol(_daemon(o), DISK_DIR)["hostPath"].update(path="/mnt/nvme")),
    _m("base", "extra-hostpath", lambda o: (_daemon(o)["volumes"].append({"name": "x", "hostPath": {"path": "/"}}),
                                             _daemon_c(o)["volumeMounts"].append({"name": "x", "mountPath": "/host"}))),
    _m("base", "toml-arena-dir", lambda o: _toml(o, 'arena_dir = "/dev/shm/tierd"', 'arena_dir = "/dev/shm"')),
    _m("base", "toml-socket", lambda o: _toml(o, 'socket = "/run/tierd/tierd.sock"', 'socket = "/tmp/t.sock"')),
    _m("base", "toml-socket-mode", lambda o: _toml(o, 'socket_mode = "0660"', 'socket_mode = "0666"')),
    _m("base", "toml-disk-path", lambda o: _toml(o, 'path = "/var/lib/tierd/disk"', 'path = "/var/cache/tierd"')),
    _m("base", "toml-allowed-gids", lambda o: _toml(o, "allowed_gids = [10001]", "allowed_gids = []")),
    _m("base", "toml-keep-off", lambda o: _toml(o, "keep = true", "keep = false")),
    _m("base", "toml-unknown-key", lambda o: _toml(o, "[host]\n", "[host]\nbites = 1\n")),
    _m("base", "toml-host-share", lambda o: _toml(o, 'bytes = "16GiB"', 'bytes = "25%"')),
    _m("base", "service-drops-not-ready", lambda o: objects(o, "Service", "tierd")[0]["spec"]
       .pop("publishNotReadyAddresses")),
    _m("base", "metrics-any-pod", lambda o: objects(o, "NetworkPolicy", "tierd")[0]["spec"]["ingress"][0].pop("from")),
    _m("overlays/monitoring", "metrics-any-pod-of-a-namespace",
       lambda o: objects(o, "NetworkPolicy", "tierd")[0]["spec"]["ingress"][0]["from"][0]
       .update(namespaceSelector={})),
    _m("base", "toml-metrics-loopback", lambda o: _toml(o, '"0.0.0.0:9464"', '"127.0.0.1:9464"')),
    _m("base", "arena-over-limit", lambda o: _toml(o, 'bytes = "16GiB"', 'bytes = "17GiB"')),
    _m("base", "memory-limit", lambda o: _daemon_c(o)["resources"]["limits"].update(memory="16Gi")),
    _m("base", "config-not-generated", lambda o: (objects(o, "ConfigMap")[0]["metadata"].update(name="tierd-config"),
                                                   next(v for v in _daemon(o)["volumes"] if "configMap" in v)
                                                   ["configMap"].update(name="tierd-config"))),
    _m("base", "privileged", lambda o: _daemon_c(o)["securityContext"].update(privileged=True)),
    _m("base", "writable-root", lambda o: _daemon_c(o)["securityContext"].update(readOnlyRootFilesystem=False)),
    _m("base", "escalation", lambda o: _daemon_c(o)["securityContext"].pop("allowPrivilegeEscalation")),
    _m("base", "caps-kept", lambda o: _daemon_c(o)["securityContext"]["capabilities"].update(drop=["NET_RAW"])),
    _m("base", "root-daemon", lambda o: _daemon_c(o)["securityContext"].update(runAsUser=0)),
    _m("base", "daemon-uid", lambda o: _daemon(o)["securityContext"].update(runAsUser=1000)),
    _m("base", "init-sys-admin", lambda o: _daemon(o)["initContainers"][0]["securityContext"]["capabilities"]
       .update(add=["CHOWN", "SYS_ADMIN"])),
    _m("base", "host-pid", lambda o: _daemon(o).update(hostPID=True)),
    _m("base", "no-seccomp", lambda o: _daemon(o)["securityContext"].pop("seccompProfile")),
    _m("base", "sa-token", lambda o: objects(o, "ServiceAccount")[0].pop("automountServiceAccountToken")),
    _m("base", "liveness", lambda o: _daemon_c(o)["livenessProbe"]["exec"].update(command=["true"])),
    _m("base", "readiness", lambda o: _daemon_c(o).pop("readinessProbe")),
    _m("base", "startup-short", lambda o: _daemon_c(o)["startupProbe"].update(failureThreshold=3)),
    _m("base", "prestop", lambda o: _daemon_c(o).pop("lifecycle")),
    _m("base", "grace", lambda o: _daemon(o).update(terminationGracePeriodSeconds=30)),
    _m("base", "no-priority-class", lambda o: _daemon(o).pop("priorityClassName")),
    _m("base", "disk-dir-or-create", lambda o: next(v for v in _daemon(o)["volumes"] if v["name"] == "disk-tier")
       ["hostPath"].update(type="DirectoryOrCreate")),
    _m("overlays/vllm", "engine-in-default", lambda o: _engine_obj(o)["metadata"].update(namespace="default")),
    _m("base", "cpu-limit", lambda o: _daemon_c(o)["resources"]["limits"].update(cpu="4")),
    _m("base", "toml-sync-on-stop-past-grace", lambda o: _toml(o, "sync_on_stop_s = 120", "sync_on_stop_s = 250")),
    _m("base", "max-unavailable", lambda o: daemon_of(o)["spec"]["updateStrategy"]["rollingUpdate"]
       .update(maxUnavailable=2)),
    _m("base", "command", lambda o: _daemon_c(o).update(command=["tierd", "serve"])),
    _m("base", "metrics-port-name", lambda o: _daemon_c(o)["ports"][0].update(name="http")),
    _m("base", "service-selector", lambda o: objects(o, "Service", "tierd")[0]["spec"]
       .update(selector={"app.kubernetes.io/name": "other"})),
    _m("base", "service-annotations", lambda o: objects(o, "Service", "tierd")[0]["metadata"].pop("annotations")),
    _m("overlays/vllm", "engine-arena-path", lambda o: _mount(_engine(o)["containers"][0], ARENA_DIR)
       .update(mountPath="/dev/shm/arena")),
    _m("overlays/vllm", "engine-socket-hostpath", lambda o: _vol(_engine(o), SOCKET_DIR)["hostPath"]
       .update(path="/var/run/tierd")),
    _m("overlays/vllm", "engine-disk", lambda o: (_engine(o)["volumes"].append(
        {"name": "d", "hostPath": {"path": DISK_DIR}}), _engine(o)["containers"][0]["volumeMounts"].append(
        {"name": "d", "mountPath": DISK_DIR}))),
    _m("overlays/vllm", "engine-groups", lambda o: _engine(o)["securityContext"].pop("supplementalGroups")),
    _m("overlays/vllm", "engine-daemon-uid", lambda o: _engine(o)["securityContext"].update(runAsUser=DAEMON_UID)),
    _m("overlays/vllm", "engine-host-network", lambda o: _engine(o).update(hostNetwork=True)),
    _m("overlays/vllm", "engine-node-selector", lambda o: _engine(o).update(nodeSelector={"gpu": "yes"})),
    _m("overlays/vllm", "engine-affinity", lambda o: _engine(o).pop("affinity")),
    _m("overlays/vllm", "engine-gpu", lambda o: _engine(o)["containers"][0]["resources"]["limits"]
       .pop("nvidia.com/gpu")),
    _m("overlays/vllm", "vllm-connector-module", lambda o: _engine(o)["containers"][0].update(
        args=[a.replace("tierd.connectors.vllm", "tierd.connectors.vllm_tier")
              for a in _engine(o)["containers"][0]["args"]])),
    _m("overlays/vllm", "vllm-url", lambda o: _engine(o)["containers"][0].update(
        args=[a.replace("unix:///run/tierd/tierd.sock", "unix:///tmp/tierd.sock")
              for a in _engine(o)["containers"][0]["args"]])),
    _m("overlays/sglang", "sglang-interface", lambda o: _engine(o)["containers"][0].update(
        args=[a.replace('"interface_v1": 1', '"interface_v1": 0') for a in _engine(o)["containers"][0]["args"]])),
    _m("overlays/sglang", "sglang-backend", lambda o: _engine(o)["containers"][0].update(
        args=[a for a in _engine(o)["containers"][0]["args"] if a != "--enable-hierarchical-cache"])),
    _m("overlays/sglang", "engine-writable-root", lambda o: _engine(o)["containers"][0]["securityContext"]
       .update(readOnlyRootFilesystem=False)),
]


@pytest.mark.parametrize("target,mutate", MUTANTS)
def test_contract_catches_a_broken_manifest(rendered, target, mutate):
    objs = copy.deepcopy(rendered[target])
    assert not contract_problems(target, objs)
    mutate(objs)
    assert contract_problems(target, objs), "this change breaks the contract, and no check saw it"


VALIDATE = r"""
import json, sys
import kubernetes_validate as kv
from kubernetes_validate import utils
docs = json.load(open(sys.argv[1]))
versions = sorted(set(utils.all_versions()), key=lambda v: tuple(map(int, v.split("."))))
latest = versions[-1]
# the oldest release the manifests claim (docs/kubernetes.md), else the minor before the latest
oldest = [v for v in versions if v.split(".")[:2] == ["1", "33"]]
previous = oldest[-1] if oldest else [v for v in versions if utils.major_minor(v) != utils.major_minor(latest)][-1]
results = []
for i, d in enumerate(docs):
    for v in (latest, previous):
        try:
            kv.validate(d, v, strict=True)
            r = "ok"
        except kv.SchemaNotFoundError as e:
            r = "no-schema: " + e.message
        except kv.ValidationError as e:
            r = "invalid: %s at /%s" % (e.message, "/".join(map(str, e.path)))
        except Exception as e:
            r = "error: %s: %s" % (type(e).__name__, e)
        results.append([i, v, r])
print(json.dumps({"versions": [latest, previous], "results": results}))
"""


def test_objects_validate_strictly_against_two_kubernetes_releases(rendered, tmp_path):
    docs, where = [], []
    for name, objs in rendered.items():
        for o in objs:
            docs.append(o)
            where.append(f"{name}: {o['kind']} {o['metadata']['name']}")
    # a broken object, so that a validator that accepted anything is caught too
    mutant = copy.deepcopy(daemon_of(rendered["base"]))
    mutant["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    docs.append(mutant)
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    r = subprocess.run([str(DEPLOY_PY), "-c", VALIDATE, str(tmp_path / "docs.json")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    latest, previous = out["versions"]
    assert latest.rsplit(".", 1)[0] != previous.rsplit(".", 1)[0], out["versions"]
    bad, crd = [], set()
    for i, v, res in out["results"]:
        if i == len(docs) - 1:
            assert res.startswith("invalid") and "securityContex" in res, \
                f"an unknown field passed validation against {v}: {res}"
            continue
        group = docs[i]["apiVersion"].split("/")[0] if "/" in docs[i]["apiVersion"] else ""
        if group in CRD_GROUPS and res.startswith("no-schema"):
            crd.add(docs[i]["kind"])
        elif res != "ok":
            bad.append(f"{where[i]} against {v}: {res}")
    assert not bad, "\n".join(bad)
    assert crd == {"PrometheusRule", "ServiceMonitor"}, crd   # checked structurally below


# rule groups only the PrometheusRule has: what only a cluster can tell (kube-state-metrics)
KUBERNETES_ONLY_GROUPS = {"tierd-kubernetes"}


def test_prometheus_rule_holds_the_systemd_alert_rules(rendered):
    alerts = load_yaml_all((ROOT / "systemd" / "prometheus-alerts.yml").read_text())[0]
    rules = [o for objs in rendered.values() for o in objects(objs, "PrometheusRule")]
    assert rules, "no PrometheusRule rendered"
    shared = {g["name"] for g in alerts["groups"]}
    assert not shared & KUBERNETES_ONLY_GROUPS
    for r in rules:
        assert r["apiVersion"] == "monitoring.coreos.com/v1"
        assert r["metadata"].get("namespace") == NAMESPACE
        assert set(r["spec"]) == {"groups"}
        groups = r["spec"]["groups"]
        assert [g for g in groups if g["name"] in shared] == alerts["groups"], \
            "the PrometheusRule's groups differ from systemd/prometheus-alerts.yml: edit both"
        assert {g["name"] for g in groups} - shared == KUBERNETES_ONLY_GROUPS, [g["name"] for g in groups]
    names = [rule["alert"] for g in rules[0]["spec"]["groups"] for rule in g["rules"]]
    assert len(names) == len(set(names)), names
    for g in rules[0]["spec"]["groups"]:
        for rule in g["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert rule["alert"] and rule["expr"] and rule["labels"].get("severity") \
                and rule["annotations"].get("summary"), rule
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
    exprs = {rule["alert"]: rule["expr"] for g in rules[0]["spec"]["groups"] for rule in g["rules"]}
    # a disk that hangs is degraded without a single I/O error: the alert reads the daemon's gauge
    assert any(re.search(r"\btierd_disk_degraded\b\s*==\s*1", e) for e in exprs.values()), exprs
    # the scrape job the rules name is the Service's (the ServiceMonitor's job label)
    for e in exprs.values():
        for job in re.findall(r'job="([^"]+)"', e):
            assert job == "tierd", e


def test_alert_rules_name_only_metrics_tierd_exports(tmp_path):
    from prometheus_client import generate_latest

    from tierd import TieredStore
    from tierd.metrics import Metrics

    from .helpers import small_config
    # every optional family exported: a remote tier (a server that is not there: degraded) and
    # host.keep (the records of the host tier)
    store = TieredStore(small_config(tmp_path, remote_url="redis://127.0.0.1:1", remote_timeout_s=0.2,
                                     host_shm_path=str(tmp_path / "arena"), host_keep=True))
    try:
        text = generate_latest(Metrics(store.stats).registry).decode()
    finally:
        store.close()
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if kind == "counter":   # the text format names a counter family with its _total, OpenMetrics without
            names.add(name if name.endswith("_total") else name + "_total")
        elif kind == "histogram":
            names |= {name + s for s in ("_bucket", "_sum", "_count")}
        else:
            names.add(name)
    groups = load_yaml_all((ROOT / "systemd" / "prometheus-alerts.yml").read_text())[0]["groups"] \
        + load_yaml_all((KUSTOMIZE_ROOT / "components" / "monitoring" / "prometheusrule.yaml").read_text())[0][
            "spec"]["groups"]
    used = {m for g in groups for r in g["rules"] for m in re.findall(r"\btierd_[a-z0-9_]+", r["expr"])}
    assert used and used <= names, f"not exported by tierd/metrics.py: {sorted(used - names)}"


def test_service_monitor_scrapes_the_daemon_service(rendered):
    objs = rendered["overlays/monitoring"]
    sm = objects(objs, "ServiceMonitor")
    svc = objects(objs, "Service", "tierd")[0]
    assert len(sm) == 1 and sm[0]["metadata"]["namespace"] == svc["metadata"]["namespace"] == NAMESPACE
    sel = sm[0]["spec"]["selector"]["matchLabels"]
    assert sel and sel.items() <= svc["metadata"]["labels"].items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert [e["port"] for e in sm[0]["spec"]["endpoints"]] == ["metrics"] and "metrics" in ports
    # instance is the node's name (one daemon per node): the same series across rollouts
    relabel = sm[0]["spec"]["endpoints"][0].get("relabelings", [])
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "instance",
            "action": "replace"} in relabel, relabel


SKIP_ANNOTATION = re.compile(r"checkov\.io/skip\d+$")
SKIP_COMMENT = re.compile(r"^#\s*checkov:skip=(CKV\w+):?(.*)$", re.M)


def waivers(item) -> list[tuple[str, str, str]]:
    """[(check id, reason, resource prefix)] of the checkov waivers in a rendered object's
    annotations, or in a Dockerfile's comments (prefix "")."""
    if isinstance(item, str):
        return [(cid, reason.strip(), "") for cid, reason in SKIP_COMMENT.findall(item)]
    meta = item.get("metadata", {})
    out = []
    for k, v in meta.get("annotations", {}).items():
        if SKIP_ANNOTATION.match(k):
            cid, _, reason = v.partition("=")
            resource = f"{item['kind']}.{meta.get('namespace', 'default')}.{meta['name']}"
            out.append((cid.strip(), reason.strip(), resource))
    return out


def unwaived(item):
    """The same object or Dockerfile without its waivers."""
    if isinstance(item, str):
        return SKIP_COMMENT.sub("", item)
    item = copy.deepcopy(item)
    ann = item.get("metadata", {}).get("annotations", {})
    for k in [k for k in ann if SKIP_ANNOTATION.match(k)]:
        del ann[k]
    return item


def failures(report: dict) -> dict[str, set[tuple[str, str]]]:
    """{file: {(check id, resource)}} of a checkov report's failed checks."""
    out: dict[str, set] = {}
    for c in report["results"].get("failed_checks", []):
        out.setdefault(c["file_path"], set()).add((c["check_id"], c["resource"]))
    return out


def waiver_problems(files: dict[str, tuple[str, object]], report: dict) -> list[str]:
    """Each waiver in `files` ({checkov's path of the real file: (checkov's path of its unwaived
    copy, rendered objects or Dockerfile text)}) gives a reason and matches a finding of the
    unwaived copy (a waiver without one is stale), and every finding there is waived."""
    failed = failures(report)
    p = []
    for path, (bare, content) in files.items():
        items = [content] if isinstance(content, str) else content
        found = failed.get(bare, set())
        covered = set()
        for item in items:
            for cid, reason, prefix in waivers(item):
                what = f"{path} {prefix or 'Dockerfile'}"
                if len(reason) < 20:
                    p.append(f"{what}: waiver of {cid} gives no reason")
                hits = {(c, r) for c, r in found if c == cid and r.startswith(prefix)}
                if not hits:
                    p.append(f"{what}: waiver of {cid} matches no finding (stale: remove it)")
                covered |= hits
        for c, r in sorted(found - covered):
            p.append(f"{path}: {c} on {r} is not waived")
    return p


def test_checkov_passes_with_only_reasoned_waivers(rendered, tmp_path):
    """checkov over every rendering and both Dockerfiles finds nothing; each waiver has its
    reason and is still needed: the same files without their waivers fail exactly those checks."""
    (tmp_path / "unwaived").mkdir()
    manifests, dockerfiles, argv_files = {}, {}, []
    for name, objs in rendered.items():
        f, g = tmp_path / (name.replace("/", "-") + ".yaml"), tmp_path / "unwaived" / (name.replace("/", "-") + ".yaml")
        f.write_text(dump_yaml_all(objs))
        g.write_text(dump_yaml_all([unwaived(o) for o in objs]))
        manifests[f] = (g, objs)
        argv_files += [f, g]
    for f in DOCKERFILES:
        g = tmp_path / "unwaived" / f.name
        g.write_text(unwaived(f.read_text()))
        dockerfiles[f] = (g, f.read_text())
        argv_files += [f, g]
    # a broken copy of the base: checkov must see it (privileged, and a waiver taken away)
    mutant = copy.deepcopy(rendered["base"])
    _daemon_c(mutant)["securityContext"]["privileged"] = True
    ann = daemon_of(mutant)["metadata"]["annotations"]
    for k in [k for k, v in ann.items() if v.startswith("CKV_K8S_25=")]:
        del ann[k]
    (tmp_path / "mutant.yaml").write_text(dump_yaml_all(mutant))
    argv_files.append(tmp_path / "mutant.yaml")
    argv = [str(CHECKOV), "--framework", "kubernetes", "dockerfile", "--skip-download", "-o", "json"]
    for f in argv_files:
        argv += ["-f", str(f)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, LOG_LEVEL="WARNING"))
    assert r.returncode in (0, 1), r.stderr[-3000:]
    reports = json.loads(r.stdout)
    reports = {x["check_type"]: x for x in (reports if isinstance(reports, list) else [reports])}
    assert set(reports) == {"kubernetes", "dockerfile"}, list(reports)
    k8s, dock = reports["kubernetes"], reports["dockerfile"]
    assert k8s["summary"]["parsing_errors"] == 0 and dock["summary"]["parsing_errors"] == 0

    def rel(f):   # checkov's name of a file it was given
        return "/" + os.path.relpath(f, tmp_path) if str(f).startswith(str(tmp_path)) else os.path.relpath(f, tmp_path)

    def key(report, f):
        paths = {c["file_path"] for kind in ("passed_checks", "failed_checks", "skipped_checks")
                 for c in report["results"].get(kind, [])}
        k = next((p for p in paths if p in (rel(f), str(f)) or os.path.normpath(p) == os.path.normpath(rel(f))), None)
        assert k, f"checkov did not check {f}: {sorted(paths)}"
        return k

    k8s_failed, dock_failed = failures(k8s), failures(dock)
    assert {c for c, _ in k8s_failed.get("/mutant.yaml", ())} >= {"CKV_K8S_16", "CKV_K8S_25"}, k8s_failed
    real = {key(k8s, f): k8s_failed.get(key(k8s, f)) for f in manifests} | \
        {key(dock, f): dock_failed.get(key(dock, f)) for f in dockerfiles}
    real = {f: v for f, v in real.items() if v}
    assert not real, f"checkov findings (fix them, or waive one in the manifest with its reason): {real}"
    # checkov looked at every workload of every rendering
    for f, (_, objs) in manifests.items():
        checked = {c["resource"] for kind in ("passed_checks", "skipped_checks")
                   for c in k8s["results"].get(kind, []) if c["file_path"] == key(k8s, f)}
        for o, _ in workloads(objs):
            assert f"{o['kind']}.{o['metadata']['namespace']}.{o['metadata']['name']}" in checked, (f, o["kind"])

    k8s_files = {key(k8s, f): (key(k8s, g), objs) for f, (g, objs) in manifests.items()}
    dock_files = {key(dock, f): (key(dock, g), text) for f, (g, text) in dockerfiles.items()}
    problems = waiver_problems(k8s_files, k8s) + waiver_problems(dock_files, dock)
    assert not problems, "\n".join(problems)

    # the audit itself: a waiver without a finding, or without a reason, is reported
    fake = copy.deepcopy(k8s_files)
    some = next(iter(fake))
    ann = daemon_of(fake[some][1])["metadata"]["annotations"]
    ann["checkov.io/skip9"] = "CKV_K8S_16=not privileged anyway, so this one is stale"
    for k, v in list(ann.items()):
        if v.startswith("CKV_K8S_43="):
            ann[k] = "CKV_K8S_43="
    found = waiver_problems(fake, k8s)
    assert any("CKV_K8S_16" in x and "stale" in x for x in found), found
    assert any("CKV_K8S_43" in x and "no reason" in x for x in found), found


def test_daemon_image_is_lean_and_unprivileged():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER 10001(:10001)?$", text, re.M), "the daemon image does not run as uid 10001"
    assert "torch" not in re.sub(r"#.*", "", text), "the daemon image needs no torch"
    assert re.search(r"^CMD \[\"serve\", \"--config\", \"/etc/tierd/tierd.toml\"\]$", text, re.M)
    for f in DOCKERFILES:   # BuildKit reads DOCKERFILE.dockerignore beside the Dockerfile
        ignore = (f.parent / (f.name + ".dockerignore")).read_text().split()
        assert "*" in ignore and "!dist/tierd-*.whl" in ignore and len([x for x in ignore if x.startswith("!")]) == 1, f
        body = re.sub(r"#.*", "", f.read_text())
        assert "COPY dist/" in body and "tierd-*-py3-none-any.whl" in body, f"{f} does not install the wheel"
    engine = re.sub(r"#.*", "", (DEPLOY / "engine.Dockerfile").read_text())
    # the engine's own packages are never changed: tierd goes in under their versions as constraints
    assert re.search(r"pip freeze --all > (\S+).*pip install [^\n]*-c \1", engine, re.S)

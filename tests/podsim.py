"""Pods on one machine, run the way a kubelet runs the manifests of deploy/kubernetes/.

Each container of a "pod" is a process in mount, PID and network namespaces of its own
(`unshare`). It sees this machine's root filesystem read-only (readOnlyRootFilesystem), its own
/dev/shm, an empty /run and /tmp like an image's (read-only unless an emptyDir is mounted
there), the Python of this checkout (the stand-in for the image's: /root is 0700 here, so
/root/.pyenv is bound into an otherwise empty /root), and the pod's volumes: hostPath volumes
from a per-test temporary "node" directory (never this machine's /run/tierd, /dev/shm/tierd or
/var/lib/tierd), emptyDirs as tmpfs, ConfigMaps as files. Then it drops to the container's
uid, gid and groups, capabilities and no_new_privs (`setpriv`) and execs.

Where the values come from is one function, `pod_specs`: the rendered manifests
(`.venv-deploy/bin/kubectl kustomize deploy/kubernetes/overlays/NAME`) where they exist, else
the node contract the manifests follow (`contract_specs`). `python tests/podsim.py worker` is
the engine side: a small JSON-lines server on stdin/stdout that drives a `tierd` client.

Needs root (namespaces, mounts, setpriv) and util-linux's unshare and setpriv.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KUBECTL = ROOT / ".venv-deploy" / "bin" / "kubectl"
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
PYTHON = sys.executable                      # the image's Python, here: this checkout's venv
WORKER = str(Path(__file__).resolve())
TOOLS = ("unshare", "setpriv", "mount", "umount")

# What a container runtime (containerd) grants a container that asks for nothing else.
DEFAULT_CAPS = frozenset({"chown", "dac_override", "fsetid", "fowner", "mknod", "net_raw", "setgid",
                          "setuid", "setfcap", "setpcap", "net_bind_service", "sys_chroot", "kill",
                          "audit_write"})
PATH_ENV = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class PodSimError(RuntimeError):
    pass


# -- what a pod is ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Volume:
    name: str
    kind: str                      # "hostPath" | "emptyDir" | "files" (a ConfigMap or Secret)
    host_path: str = ""            # hostPath: the path on the node
    host_type: str = ""            # hostPath: DirectoryOrCreate, Directory, ...
    files: tuple = ()              # files: ((name, bytes), ...)
    size: str = ""                 # emptyDir: sizeLimit


@dataclass(frozen=True)
class Mount:
    path: str                      # in the container
    volume: Volume
    sub_path: str = ""
    read_only: bool = False


@dataclass(frozen=True)
class Container:
    name: str
    uid: int
    gid: int
    groups: tuple = ()             # supplementary groups
    read_only_root: bool = True
    no_new_privs: bool = True
    caps: frozenset = frozenset()  # bounding set (what root keeps; a non-root uid keeps none...)
    ambient: frozenset = frozenset()   # ... unless ambient (tests only: no pod spec can say so)
    mounts: tuple = ()
    env: tuple = ()                # ((name, value), ...)
    argv: tuple = ()               # command + args, as in the manifest
    workdir: str = "/"

    def mount_at(self, path: str) -> Mount | None:
        return next((m for m in self.mounts if m.path.rstrip("/") == path.rstrip("/")), None)

    def without_mount(self, path: str) -> "Container":
        assert self.mount_at(path) is not None, f"{self.name} mounts nothing at {path}"
        return replace(self, mounts=tuple(m for m in self.mounts if m.path.rstrip("/") != path.rstrip("/")))

    @property
    def environ(self) -> dict:
        return dict(self.env)


@dataclass(frozen=True)
class PodSpec:
    name: str
    main: Container
    init: tuple = ()               # init containers, run in order before main
    source: str = ""               # where these values came from

    def config_text(self) -> str:
        """The daemon's config file, as its container sees it (`--config PATH` in its command,
        from the volume mounted there)."""
        argv = list(self.main.argv)
        path = argv[argv.index("--config") + 1] if "--config" in argv else "/etc/tierd/tierd.toml"
        best = None
        for m in self.main.mounts:
            if m.volume.kind == "files" and (path == m.path or path.startswith(m.path.rstrip("/") + "/")):
                best = m
        if best is None:
            raise PodSimError(f"{self.name}: nothing mounted provides its config file {path}")
        rel = best.sub_path or os.path.relpath(path, best.path)
        for name, data in best.volume.files:
            if name == rel:
                return data.decode()
        raise PodSimError(f"{self.name}: volume {best.volume.name} has no {rel} (for {path})")

    def config(self) -> dict:
        """The daemon's settings that tie engines to it (tierd.config's defaults where the file
        is silent)."""
        from tierd.config import read_toml
        v = read_toml("<config>", self.config_text().encode())
        return {"socket": v.get("socket", "/run/tierd/tierd.sock"), "socket_mode": v.get("socket_mode", "0660"),
                "arena_dir": v.get("arena_dir", "/dev/shm"), "allowed_uids": list(v.get("allowed_uids", [])),
                "allowed_gids": list(v.get("allowed_gids", [])), "disk_path": v.get("disk.path"),
                "host_keep": v.get("host.keep", True), "raw": v}


# -- where the values come from ---------------------------------------------------------------

CONTRACT_TOML = """\
socket = "/run/tierd/tierd.sock"
socket_mode = "0660"
arena_dir = "/dev/shm/tierd"
metrics_addr = "0.0.0.0:9464"
allowed_gids = [10001]
sync_on_stop = true
[host]
bytes = "16GiB"
keep = true
[disk]
path = "/var/lib/tierd/disk"
bytes = "10%"
"""


def contract_specs() -> tuple[PodSpec, PodSpec]:
    """The node contract the manifests follow (the values to use until they exist)."""
    sock = Volume("socket-dir", "hostPath", "/run/tierd", "DirectoryOrCreate")
    arena = Volume("host-arena", "hostPath", "/dev/shm/tierd", "DirectoryOrCreate")
    disk = Volume("disk-tier", "hostPath", "/var/lib/tierd", "Directory")
    tmp = Volume("tmp", "emptyDir", size="64Mi")
    cfg = Volume("config", "files", files=(("tierd.toml", CONTRACT_TOML.encode()),))
    dirs = (Mount("/run/tierd", sock), Mount("/dev/shm/tierd", arena), Mount("/var/lib/tierd", disk))
    host_dirs = Container("host-dirs", 0, 0, (), caps=frozenset({"chown", "fowner"}), mounts=dirs, argv=(
        "/bin/sh", "-ec", "chown 10001:10001 /run/tierd /dev/shm/tierd /var/lib/tierd\n"
        "chmod 0750 /run/tierd /dev/shm/tierd\nchmod 0700 /var/lib/tierd\n"))
    daemon = Container("tierd", 10001, 10001, (10001,), mounts=(Mount("/etc/tierd", cfg, read_only=True), *dirs,
                                                               Mount("/tmp", tmp)),
                       argv=("tierd", "serve", "--config", "/etc/tierd/tierd.toml"))
    engine = Container("engine", 10002, 10002, (10001, 10002), mounts=(
        Mount("/run/tierd", sock), Mount("/dev/shm/tierd", arena), Mount("/tmp", Volume("tmp", "emptyDir"))),
        env=(("HOME", "/tmp"), ("TIERD_URL", "unix:///run/tierd/tierd.sock")))
    return (PodSpec("tierd", daemon, (host_dirs,), "the node contract (no manifests)"),
            PodSpec("engine", engine, (), "the node contract (no manifests)"))


def deploy_tools_missing() -> str | None:
    """Why the manifests cannot be rendered here, or None."""
    if not KUBECTL.exists():
        return f"no {KUBECTL}: `make deploy-env` builds it (kubectl renders deploy/kubernetes)"
    return None


_RENDERED: dict[str, list] = {}


def render(overlay: str) -> list[dict]:
    """The objects `kubectl kustomize deploy/kubernetes/overlays/OVERLAY` renders."""
    if overlay not in _RENDERED:
        import yaml
        d = KUSTOMIZE / "overlays" / overlay
        r = subprocess.run([str(KUBECTL), "kustomize", str(d)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise PodSimError(f"kubectl kustomize {d} failed: {r.stderr.strip()[-2000:]}")
        _RENDERED[overlay] = [o for o in yaml.safe_load_all(r.stdout) if o]
    return _RENDERED[overlay]


def pod_specs(overlay: str = "vllm") -> tuple[PodSpec, PodSpec]:
    """The daemon's and the engine's pod: from the rendered overlay where it exists, else the
    node contract (also with PODSIM_SPECS=contract). The one switch between the two."""
    if os.environ.get("PODSIM_SPECS") == "contract":
        return contract_specs()
    if (KUSTOMIZE / "overlays" / overlay / "kustomization.yaml").exists() and deploy_tools_missing() is None:
        return specs_from_manifests(render(overlay), f"kubectl kustomize deploy/kubernetes/overlays/{overlay}")
    return contract_specs()


def _pod_template(obj: dict) -> dict | None:
    kind = obj.get("kind")
    if kind == "Pod":
        return obj
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return obj["spec"]["template"]
    return None


def _cmd_text(c: dict) -> str:
    return " ".join(str(x) for x in (c.get("command") or []) + (c.get("args") or []))


def specs_from_manifests(objs: list[dict], source: str) -> tuple[PodSpec, PodSpec]:
    """The tierd DaemonSet's pod and the engine's (the workload whose container mounts the
    daemon's socket directory) out of rendered manifests."""
    files = {}
    for o in objs:
        if o.get("kind") in ("ConfigMap", "Secret"):
            data = {k: str(v).encode() for k, v in (o.get("data") or {}).items()} if o["kind"] == "ConfigMap" else \
                {k: base64.b64decode(v) for k, v in (o.get("data") or {}).items()}
            if o["kind"] == "ConfigMap":
                data.update({k: base64.b64decode(v) for k, v in (o.get("binaryData") or {}).items()})
            data.update({k: str(v).encode() for k, v in (o.get("stringData") or {}).items()})
            files[(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])] = data
    pods = []
    for o in objs:
        t = _pod_template(o)
        if t is not None:
            pods.append((o, t))
    daemons = [(o, t) for o, t in pods if o["kind"] == "DaemonSet"
               and any(re.search(r"(^|[ /])tierd serve|-m tierd serve", _cmd_text(c)) for c in t["spec"]["containers"])]
    if len(daemons) != 1:
        raise PodSimError(f"{source}: expected one DaemonSet running `tierd serve`, found {len(daemons)}")
    d_obj, d_t = daemons[0]
    d_main = next(c for c in d_t["spec"]["containers"] if "serve" in _cmd_text(c))
    daemon = _pod_spec(d_obj, d_t, d_main, files, source)
    sock_dir = os.path.dirname(daemon.config()["socket"])
    sock_vol = daemon.main.mount_at(sock_dir)
    if sock_vol is None or sock_vol.volume.kind != "hostPath":
        raise PodSimError(f"{source}: the daemon does not mount its socket directory {sock_dir} from a hostPath")
    engines = []
    for o, t in pods:
        if o is d_obj:
            continue
        vols = {v["name"]: v for v in t["spec"].get("volumes") or []}
        for c in t["spec"]["containers"]:
            for vm in c.get("volumeMounts") or []:
                hp = (vols.get(vm["name"]) or {}).get("hostPath") or {}
                if hp.get("path", "").rstrip("/") == sock_vol.volume.host_path.rstrip("/"):
                    engines.append((o, t, c))
                    break
    if len(engines) != 1:
        raise PodSimError(f"{source}: expected one engine container mounting hostPath {sock_vol.volume.host_path}, "
                          f"found {[(o['metadata']['name'], c['name']) for o, _, c in engines]}")
    e_obj, e_t, e_c = engines[0]
    return daemon, _pod_spec(e_obj, e_t, e_c, files, source)


def _quantity(v) -> str:
    """A Kubernetes quantity as a tmpfs size= (binary units)."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(v or ""))
    if not m:
        return ""
    return m.group(1) + {"Ki": "k", "Mi": "m", "Gi": "g", "Ti": "t", "k": "k", "M": "m", "G": "g", "T": "t",
                         None: ""}[m.group(2)]


def _volume(v: dict, ns: str | None, files: dict, source: str) -> Volume:
    name = v["name"]
    if "hostPath" in v:
        return Volume(name, "hostPath", v["hostPath"]["path"], v["hostPath"].get("type", ""))
    if "emptyDir" in v:
        return Volume(name, "emptyDir", size=(v["emptyDir"] or {}).get("sizeLimit", ""))
    for kind, key, ref in (("ConfigMap", "configMap", "name"), ("Secret", "secret", "secretName")):
        if key in v:
            data = files.get((kind, ns, v[key][ref]))
            if data is None:
                if v[key].get("optional"):
                    data = {}
                else:
                    raise PodSimError(f"{source}: volume {name}: {kind} {v[key][ref]} is not in the manifests")
            items = v[key].get("items")
            if items:
                data = {i["path"]: data[i["key"]] for i in items}
            return Volume(name, "files", files=tuple(sorted(data.items())))
    raise PodSimError(f"{source}: volume {name}: kind {sorted(set(v) - {'name'})} is not simulated")


def _pod_spec(obj: dict, t: dict, main: dict, files: dict, source: str) -> PodSpec:
    spec = t["spec"]
    ns = obj["metadata"].get("namespace")
    vols = {v["name"]: _volume(v, ns, files, source) for v in spec.get("volumes") or []}
    psc = spec.get("securityContext") or {}

    def container(c: dict) -> Container:
        csc = c.get("securityContext") or {}
        uid = csc.get("runAsUser", psc.get("runAsUser"))
        if uid is None:
            raise PodSimError(f"{source}: container {c['name']} names no runAsUser (the image's user is not "
                              "simulated)")
        gid = csc.get("runAsGroup", psc.get("runAsGroup", 0))
        # containerd: the primary gid, supplementalGroups and fsGroup (no /etc/group entries:
        # the image is not simulated)
        groups = {gid, *(psc.get("supplementalGroups") or [])}
        if psc.get("fsGroup") is not None:
            groups.add(psc["fsGroup"])
        capsc = csc.get("capabilities") or {}
        drop = {x.lower().removeprefix("cap_") for x in capsc.get("drop") or []}
        add = {x.lower().removeprefix("cap_") for x in capsc.get("add") or []}
        caps = set() if "all" in drop else set(DEFAULT_CAPS) - drop
        caps |= add
        if csc.get("privileged"):
            raise PodSimError(f"{source}: container {c['name']} is privileged (not simulated)")
        env = []
        for e in c.get("env") or []:
            if "value" in e:
                env.append((e["name"], str(e["value"])))
        mounts = []
        for vm in c.get("volumeMounts") or []:
            v = vols[vm["name"]]
            ro = bool(vm.get("readOnly")) or v.kind == "files"   # ConfigMaps/Secrets: always read-only
            mounts.append(Mount(vm["mountPath"], v, vm.get("subPath", ""), ro))
        return Container(c["name"], int(uid), int(gid), tuple(sorted(groups)),
                         read_only_root=bool(csc.get("readOnlyRootFilesystem", False)),
                         no_new_privs=csc.get("allowPrivilegeEscalation") is False,
                         caps=frozenset(caps), mounts=tuple(mounts), env=tuple(env),
                         argv=tuple(str(x) for x in (c.get("command") or []) + (c.get("args") or [])),
                         workdir=c.get("workingDir", "/"))

    init = tuple(container(c) for c in spec.get("initContainers") or [])
    return PodSpec(obj["metadata"]["name"], container(main), init, source)


def engine_url(engine: PodSpec, daemon: PodSpec) -> str:
    """The daemon URL the engine is configured with (a `unix://` URL in its command line or
    environment), else the daemon's socket."""
    for text in (*engine.main.argv, *(v for _, v in engine.main.env)):
        m = re.search(r"unix://[^\"',\s}]+", text)
        if m:
            return m.group(0)
    return "unix://" + daemon.config()["socket"]


# -- the node and its pods ------------------------------------------------------------------

class Node:
    """A node's filesystem for hostPath volumes: a temporary directory (on tmpfs, as a node's
    /dev/shm is) that stands in for the node's /. Removed by `close`."""

    def __init__(self):
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.root = tempfile.mkdtemp(prefix="tierd-podsim-node-", dir=base)
        os.chmod(self.root, 0o700)
        self.prepared: list[str] = []

    def path(self, host_path: str) -> str:
        return os.path.join(self.root, host_path.lstrip("/"))

    def volume_source(self, pod: str, m: Mount) -> tuple[str, bool]:
        """(source on this machine, is_file) of a mount, made as a kubelet makes it."""
        v = m.volume
        if v.kind == "hostPath":
            p = self.path(v.host_path)
            t = v.host_type or "DirectoryOrCreate"
            if t in ("DirectoryOrCreate", "Directory"):
                if not os.path.isdir(p):
                    # DirectoryOrCreate: kubelet makes it root:root 0755. Directory: the node
                    # must have it -- here it is made the same way, as the node's operator would
                    os.makedirs(p, 0o755, exist_ok=True)
                    os.chmod(p, 0o755)
                    self.prepared.append(f"{v.host_path} ({t}, made root:root 0755)")
            elif t == "FileOrCreate":
                os.makedirs(os.path.dirname(p), 0o755, exist_ok=True)
                if not os.path.exists(p):
                    open(p, "a").close()
                    os.chmod(p, 0o644)
            elif not os.path.exists(p):
                raise PodSimError(f"hostPath {v.host_path} (type {t}) does not exist on the node")
            src = os.path.join(p, m.sub_path) if m.sub_path else p
            return src, os.path.isfile(src)
        if v.kind == "files":
            d = os.path.join(self.root, "var/lib/kubelet/pods", pod, "volumes", v.name)
            os.makedirs(d, 0o755, exist_ok=True)
            os.chmod(d, 0o755)
            for name, data in v.files:
                f = os.path.join(d, name)
                os.makedirs(os.path.dirname(f), 0o755, exist_ok=True)
                with open(f, "wb") as fh:
                    fh.write(data)
                os.chmod(f, 0o644)
            src = os.path.join(d, m.sub_path) if m.sub_path else d
            return src, os.path.isfile(src)
        raise PodSimError(f"volume {v.name}: {v.kind} has no source on the node")

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _within(path: str, d: str) -> bool:
    d = d.rstrip("/") or "/"
    return path == d or path.startswith(d.rstrip("/") + "/")


def _scaffold_dir() -> str:
    """An existing empty directory of this machine to hold a pod's setup mounts (hidden again
    before the container runs)."""
    for d in ("/media", "/srv", "/mnt"):
        if os.path.isdir(d) and not os.path.ismount(d):
            return d
    raise PodSimError("no /media, /srv or /mnt to set pods up in")


class _Script:
    """The shell commands that build one container's mount namespace, as root inside it."""

    def __init__(self, node: Node, pod: str, c: Container):
        self.node, self.pod, self.c = node, pod, c
        self.lines: list[str] = []
        self.covered: dict[str, str] = {}     # our writable mounts over the image: path -> kind
        self.skipped: list[str] = []
        self.S = _scaffold_dir()
        self._n = 0

    def run(self, *argv) -> None:
        self.lines.append(" ".join(shlex.quote(str(a)) for a in argv))

    def tmpfs(self, path: str, mode: str, size: str = "", cover: str = "image") -> None:
        opts = f"mode={mode},nosuid,nodev" + (f",size={size}" if size else "")
        self.run("mount", "-t", "tmpfs", "-o", opts, f"podsim-{cover}", path)
        self.covered[path] = cover

    def overlay(self, lower: str) -> None:
        self._n += 1
        up, work = f"{self.S}/ovl/{self._n}/up", f"{self.S}/ovl/{self._n}/work"
        self.run("mkdir", "-p", up, work)
        self.run("mount", "-t", "overlay", "-o", f"lowerdir={lower},upperdir={up},workdir={work}",
                 "podsim-image", lower)
        self.covered[lower] = "image"

    def mountpoint(self, target: str, is_file: bool) -> bool:
        """Make `target` exist (as the runtime makes mountpoints in a container's root); False
        where it cannot be made without writing to this machine's root filesystem."""
        parent = os.path.dirname(target) if is_file else target
        cov = max((p for p in self.covered if _within(parent, p)), key=len, default=None)
        if cov is None:
            if (os.path.isfile(target) if is_file else os.path.isdir(target)):
                return True                       # already in the "image" (this machine's root)
            a = os.path.dirname(target)
            while not os.path.isdir(a):
                a = os.path.dirname(a)
            if a == "/":
                return False                      # a new top-level directory: not simulated
            self.overlay(a)
        self.run("mkdir", "-p", parent)
        if is_file:
            self.lines.append(f"[ -e {shlex.quote(target)} ] || : > {shlex.quote(target)}")
        return True

    def build(self, argv: list[str], env: dict) -> str:
        S, c = self.S, self.c
        if shutil.which("ip"):
            self.lines.append("ip link set lo up 2>/dev/null || true")
        self.run("mount", "-t", "tmpfs", "-o", "mode=0700,size=16m", "podsim-setup", S)
        self.run("mkdir", f"{S}/node", f"{S}/py", f"{S}/repo")
        self.run("mount", "--bind", self.node.root, f"{S}/node")
        # the image's code: this checkout, wherever it lies (a clone under /tmp would be hidden
        # by the container's own /tmp below: bound back at its path, read-only)
        self.run("mount", "--bind", str(ROOT), f"{S}/repo")
        # the image's Python: this checkout's interpreter under /root/.pyenv (/root is 0700)
        py_real = os.path.realpath(PYTHON)
        if _within(py_real, "/root"):
            top = "/root/" + os.path.relpath(py_real, "/root").split("/")[0]
            self.run("mount", "--bind", top, f"{S}/py")
            self.tmpfs("/root", "0755", "1m")
            self.run("mkdir", top)
            self.run("mount", "--bind", f"{S}/py", top)
            self.run("mount", "-o", "remount,bind,ro", top)
        # what the runtime gives every container: its own /dev/shm; and the image's empty /run, /tmp
        self.tmpfs("/dev/shm", "1777", "64m", "runtime")
        for d in ("/run", "/tmp"):
            if os.path.isdir(d):
                self.tmpfs(d, "1777" if d == "/tmp" else "0755", "1m")
        for m in sorted(c.mounts, key=lambda m: m.path.rstrip("/").count("/")):   # parents first
            target = m.path.rstrip("/") or "/"
            if m.volume.kind == "emptyDir":
                if not self.mountpoint(target, False):
                    self.skipped.append(target)
                    continue
                self.tmpfs(target, "1777", _quantity(m.volume.size) or "256m", "volume")
                if m.read_only:
                    self.run("mount", "-o", "remount,bind,ro", target)
                continue
            src, is_file = self.node.volume_source(self.pod, m)
            if not self.mountpoint(target, is_file):
                self.skipped.append(target)
                continue
            self.run("mount", "--bind", f"{S}/node/" + os.path.relpath(src, self.node.root), target)
            if m.read_only:
                self.run("mount", "-o", "remount,bind,ro", target)
            if not is_file:
                self.covered[target] = "volume"
        # the checkout, where the container's own /tmp, /run or volumes hide it
        if any(_within(str(ROOT), d) for d in ("/run", "/tmp", "/dev/shm", *(m.path for m in c.mounts))):
            self.run("mkdir", "-p", str(ROOT))
            self.run("mount", "--bind", f"{S}/repo", str(ROOT))
            self.run("mount", "-o", "remount,bind,ro", str(ROOT))
        # seal: the image is read-only (readOnlyRootFilesystem); this machine's root always is
        for p, kind in sorted(self.covered.items(), key=lambda kv: -kv[0].count("/")):
            if kind == "image" and c.read_only_root:
                self.run("mount", "-o", "remount,bind,ro", p)
        self.run("mount", "-o", "remount,bind,ro", "/")
        self.run("umount", "-l", S)
        self.run("cd", c.workdir)
        setpriv = [shutil.which("setpriv"), f"--reuid={c.uid}", f"--regid={c.gid}"]
        setpriv.append(f"--groups={','.join(map(str, c.groups))}" if c.groups else "--clear-groups")
        inh = ["-all"] + [f"+{x}" for x in sorted(c.ambient)]
        setpriv += [f"--inh-caps={','.join(inh)}",
                    f"--bounding-set={','.join(['-all'] + [f'+{x}' for x in sorted(c.caps | c.ambient)])}"]
        if c.ambient:
            setpriv.append(f"--ambient-caps={','.join('+' + x for x in sorted(c.ambient))}")
        if c.no_new_privs:
            setpriv.append("--no-new-privs")
        envv = [f"{k}={v}" for k, v in env.items()]
        self.run("exec", shutil.which("env"), "-i", *envv, *setpriv, "--", *argv)
        return "\n".join(self.lines) + "\n"


def _pdeathsig() -> None:
    """In the child before exec: die with the test process (unshare --kill-child then takes
    the container with it)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG


def tools_missing() -> str | None:
    if os.geteuid() != 0:
        return "pods are simulated with namespaces and mounts: needs root"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (util-linux)"
    return None


class Pod:
    """One pod on a `Node`: its init containers run to completion, then its main container
    runs with `argv` (default: the spec's command, `tierd` run by this checkout's Python)."""

    def __init__(self, node: Node, spec: PodSpec, logdir: str | Path, *, argv: list[str] | None = None,
                 env: dict | None = None, name: str | None = None):
        self.node, self.spec = node, spec
        self.name = name or spec.name
        self.logdir = Path(logdir)
        self.argv = argv if argv is not None else image_argv(spec.main.argv)
        self.env = {"PATH": PATH_ENV, "HOME": "/", "HOSTNAME": self.name, **spec.main.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.skipped: list[str] = []
        self.log = self.logdir / f"{self.name}.log"

    def _launch(self, c: Container, argv: list[str], env: dict, *, stdin=None, stdout=None,
                stderr=None) -> subprocess.Popen:
        s = _Script(self.node, self.name, c)
        script = s.build(argv, env)
        self.skipped += [f"{c.name}: {p}" for p in s.skipped]
        return subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "--net",
             "--kill-child", "--", "/bin/sh", "-ec", script],
            stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True, preexec_fn=_pdeathsig)

    def start(self, *, stdin: bool = False, timeout_s: float = 30) -> "Pod":
        self.logdir.mkdir(parents=True, exist_ok=True)
        for c in self.spec.init:
            with open(self.logdir / f"{self.name}.{c.name}.log", "ab") as f:
                p = self._launch(c, list(c.argv), {"PATH": PATH_ENV, "HOME": "/", **c.environ},
                                 stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
                try:
                    rc = p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    raise PodSimError(f"{self.name}: init container {c.name} did not finish in {timeout_s}s")
            if rc != 0:
                raise PodSimError(f"{self.name}: init container {c.name} exited {rc}: "
                                  f"{(self.logdir / f'{self.name}.{c.name}.log').read_text()[-2000:]}")
        self._logf = open(self.log, "ab")
        self.proc = self._launch(self.spec.main, self.argv, self.env, stdin=subprocess.PIPE if stdin else
                                 subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._logf)
        return self

    def main_pid(self, timeout_s: float = 10) -> int:
        """The container's process (PID 1 of its PID namespace) as this machine numbers it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                    kids = f.read().split()
            except OSError:
                kids = []
            if kids:
                return int(kids[0])
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        raise PodSimError(f"{self.name}: no container process")

    def mounts(self) -> dict[str, list[str]]:
        """The container's mounts as its process sees them: mount point -> per-mount options
        (the topmost mount at each point)."""
        out = {}
        with open(f"/proc/{self.main_pid()}/mountinfo") as f:
            for line in f:
                parts = line.split()
                out[parts[4].replace("\\040", " ")] = parts[5].split(",")
        return out

    def read_line(self, timeout_s: float) -> bytes:
        """The next line the container writes to stdout ('' at its end), within a deadline."""
        out = self.proc.stdout
        deadline = time.monotonic() + timeout_s
        buf = getattr(self, "_rbuf", b"")
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self._rbuf = buf
                raise TimeoutError(f"{self.name}: no reply within {timeout_s}s; log: {self.log_tail()}")
            r, _, _ = select.select([out], [], [], left)
            if not r:
                continue
            chunk = os.read(out.fileno(), 65536)
            if not chunk:
                self._rbuf = b""
                return buf
            buf += chunk
        line, _, self._rbuf = buf.partition(b"\n")
        return line + b"\n"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout_s: float = 30) -> int:
        """SIGTERM to the container's process, as the kubelet stops a pod; its exit status."""
        os.kill(self.main_pid(), signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        """SIGKILL to everything the pod started (its process group; once `unshare` is
        reaped, --kill-child and the PID namespace's end took the rest); idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:          # not reaped yet: the group id is still ours
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        if getattr(self, "_logf", None) is not None:
            self._logf.close()
            self._logf = None


def image_argv(argv) -> list[str]:
    """A container command as this machine runs it: `tierd ...` (the image's entry point) and
    `python -m tierd ...` with this checkout's Python."""
    argv = list(argv)
    if argv and os.path.basename(argv[0]) == "tierd":
        return [PYTHON, "-m", "tierd", *argv[1:]]
    if argv and re.fullmatch(r"python3?(\.\d+)?", os.path.basename(argv[0])):
        return [PYTHON, *argv[1:]]
    return argv


class DaemonPod(Pod):
    def start(self, *, timeout_s: float = 60, **kw) -> "DaemonPod":
        super().start(**kw)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.read_line(max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                raise PodSimError(f"{self.name}: the daemon did not start within {timeout_s}s:\n{self.log_tail()}")
            if not line:
                raise PodSimError(f"{self.name}: the daemon exited ({self.proc.wait()}):\n{self.log_tail()}"
                                  + (f"\n(mounts not simulated: {self.skipped})" if self.skipped else ""))
            if b"tierd: serving" in line:
                self.ready_line = line.decode().strip()
                return self


class EnginePod(Pod):
    """The engine side: `python tests/podsim.py worker` in the engine's container."""

    def __init__(self, node, spec, logdir, **kw):
        super().__init__(node, spec, logdir, argv=[PYTHON, WORKER, "worker"], **kw)

    def start(self, **kw) -> "EnginePod":
        return super().start(stdin=True, **kw)

    def call(self, cmd: str, timeout_s: float = 30, **args):
        """Run one worker command; its reply ({"ok": ...} or {"error": {...}}, "elapsed_s")."""
        self.proc.stdin.write((json.dumps({"cmd": cmd, "args": args}) + "\n").encode())
        self.proc.stdin.flush()
        line = self.read_line(timeout_s)
        if not line:
            raise PodSimError(f"{self.name}: the worker exited ({self.proc.wait()}):\n{self.log_tail()}")
        return json.loads(line)

    def ok(self, cmd: str, timeout_s: float = 30, **args):
        r = self.call(cmd, timeout_s, **args)
        if "error" in r:
            raise AssertionError(f"{self.name}: {cmd} failed: {r['error']['type']}: {r['error']['message']}")
        return r["ok"]


# -- the engine side: a worker in the engine's container -----------------------------------------

NS_FIELDS = dict(model="podsim-model", kv_dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                 block_tokens=16)   # 16 KiB blocks


def block_bytes_for(key: bytes, nbytes: int) -> bytes:
    """Deterministic content of the block named `key` (both sides compute it)."""
    out = bytearray()
    i = 0
    while len(out) < nbytes:
        out += hashlib.blake2b(key + i.to_bytes(8, "little"), digest_size=64).digest()
        i += 1
    return bytes(out[:nbytes])


def chain_keys(seed: int, n: int, ns_fields: dict = NS_FIELDS) -> list[bytes]:
    from tierd import Namespace
    ns = Namespace(**ns_fields)
    toks = [(seed * 7919 + i * 104729) % 32000 for i in range(n * ns.block_tokens)]
    return ns.block_keys(toks)


def _w_whoami(state, paths=(), write=()):
    info = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()), "pid": os.getpid(),
            "cap_eff": next((ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("CapEff")), ""),
            "no_new_privs": next((ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("NoNewPrivs")),
                                 ""),
            "stat": {}, "readonly": {}, "write": {}}
    for p in paths:
        try:
            st = os.stat(p)
            info["stat"][p] = [st.st_dev, st.st_ino, st.st_uid, st.st_gid, st.st_mode]
            info["readonly"][p] = bool(os.statvfs(p).f_flag & os.ST_RDONLY)
        except OSError as e:
            info["stat"][p] = str(e)
    for d in write:
        f = os.path.join(d, f".podsim-probe-{os.getpid()}")
        try:
            with open(f, "w"):
                pass
            os.unlink(f)
            info["write"][d] = "ok"
        except OSError as e:
            info["write"][d] = os.strerror(e.errno)
    return info


def _ns(state):
    from tierd import Namespace
    return Namespace(**NS_FIELDS)


def _w_connect(state, url):
    import tierd
    t0 = time.monotonic()
    state["client"] = tierd.connect(url)
    return {"client_id": id(state["client"]), "server": getattr(state["client"], "server_version", None),
            "seconds": time.monotonic() - t0}


def _w_put(state, seed, n):
    c, ns = state["client"], _ns(state)
    keys = chain_keys(seed, n)
    stored = c.put(ns, keys, [block_bytes_for(k, ns.block_bytes) for k in keys])
    return {"stored": stored, "keys": [k.hex() for k in keys]}


def _w_read(state, seed, n):
    """Lookup, where, a lease (bytes compared in the arena, zero-copy) and a get (copied out)."""
    import numpy as np
    c, ns = state["client"], _ns(state)
    keys = chain_keys(seed, n)
    out = {"client_id": id(c), "lookup": c.lookup(ns, keys), "where": c.where(ns, keys)}
    lease = c.acquire(ns, keys)
    try:
        out["lease_tiers"] = list(lease.tiers)
        out["lease_equal"] = [bytes(np.asarray(b).view(np.uint8).reshape(-1)) == block_bytes_for(k, ns.block_bytes)
                              for b, k in zip(lease.buffers, keys)]
    finally:
        c.release(lease)
    got = c.get(ns, keys)
    out["get_sha256"] = [hashlib.sha256(bytes(np.asarray(g).view(np.uint8).reshape(-1))).hexdigest() for g in got]
    out["reconnects"] = c.reconnects
    return out


def _w_stats(state):
    return state["client"].stats()


def _w_reconnects(state):
    return state["client"].reconnects


WORKER_COMMANDS = {"whoami": _w_whoami, "connect": _w_connect, "put": _w_put, "read": _w_read,
                   "stats": _w_stats, "reconnects": _w_reconnects}


def worker_main() -> None:
    state: dict = {}
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.monotonic()
        try:
            out = {"ok": WORKER_COMMANDS[req["cmd"]](state, **req.get("args", {}))}
        except Exception as e:  # noqa: BLE001 -- every failure goes back to the test
            out = {"error": {"type": type(e).__name__, "message": str(e)}}
        out["elapsed_s"] = time.monotonic() - t0
        sys.stdout.write(json.dumps(out, default=str) + "\n")
        sys.stdout.flush()


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    # run as a script: this directory is sys.path[0]; its test modules must not shadow packages
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(WORKER)]
    worker_main()

"""The Kubernetes manifests of deploy/kubernetes/, run for real across pod boundaries.

The daemon and the engine run the way their pods would (tests/podsim.py): each container in
mount, PID and network namespaces of its own, this machine's root read-only, its own /dev/shm,
/run and /tmp, only the volumes its manifest mounts (hostPaths from a temporary node
directory, never this machine's /run/tierd, /dev/shm/tierd or /var/lib/tierd), as the uid,
gid and groups its securityContext names. Values come from the rendered overlays (`kubectl
kustomize`, .venv-deploy: `make deploy-env`); without .venv-deploy these tests are skipped, or
fail where it is part of the suite (TEST_REQUIRE_DEPLOY=1). Needs root (namespaces, mounts).
"""

from __future__ import annotations

import glob
import hashlib
import os
import stat
import subprocess
import time
from dataclasses import replace

import pytest

from . import podsim
from .podsim import DaemonPod, EnginePod

pytestmark = [pytest.mark.timeout(240)]

REQUIRE = bool(os.environ.get("TEST_REQUIRE_DEPLOY"))
OVERLAYS = ("vllm", "sglang")
# the config's sizes, made small for this machine (TIERD_* overrides the config file)
SMALL = {"TIERD_HOST_BYTES": "16MiB", "TIERD_HOST_SLAB_BYTES": "1MiB", "TIERD_DISK_BYTES": "32MiB",
         "TIERD_DISK_SLAB_BYTES": "4MiB", "TIERD_DISK_FILE_BYTES": "16MiB"}
NO_HANG_S = 10.0     # a refused or misconfigured engine hears why within this


def _unavailable() -> str | None:
    why = podsim.tools_missing() or podsim.deploy_tools_missing()
    if why is None:
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--net", "true"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            why = f"cannot make namespaces here (unshare: {r.stderr.strip()})"
    return why


def _specs(overlay: str):
    why = _unavailable()
    if why:
        if REQUIRE:
            pytest.fail(f"the deploy environment is part of this suite here (TEST_REQUIRE_DEPLOY), and: {why}")
        pytest.skip(why)
    if REQUIRE and not (podsim.KUSTOMIZE / "overlays" / overlay / "kustomization.yaml").exists():
        pytest.fail(f"TEST_REQUIRE_DEPLOY: deploy/kubernetes/overlays/{overlay} is missing")
    return podsim.pod_specs(overlay)


class Cluster:
    """One node: its directory, the tierd DaemonSet's pod on it and engine pods beside it."""

    def __init__(self, overlay: str, logdir):
        self.overlay = overlay
        self.daemon_spec, self.engine_spec = _specs(overlay)
        self.cfg = self.daemon_spec.config()
        self.url = podsim.engine_url(self.engine_spec, self.daemon_spec)
        self.logdir = logdir
        self.node = podsim.Node()
        self.pods: list[podsim.Pod] = []
        self.daemon: DaemonPod | None = None

    def share(self, other: "Cluster") -> None:
        """Use `other`'s node and daemon (the same daemon pod): this one's engines run there."""
        self.node.close()
        self.node, self.daemon, self.pods = other.node, other.daemon, other.pods

    def start_daemon(self) -> DaemonPod:
        n = sum(isinstance(p, DaemonPod) for p in self.pods)
        self.daemon = DaemonPod(self.node, self.daemon_spec, self.logdir, env=SMALL, name=f"tierd-{n}")
        self.pods.append(self.daemon)
        return self.daemon.start()

    def engine(self, main: podsim.Container | None = None, *, spec: podsim.PodSpec | None = None,
               name: str = "engine") -> EnginePod:
        spec = spec or self.engine_spec
        if main is not None:
            spec = replace(spec, main=main)
        p = EnginePod(self.node, spec, self.logdir, name=f"{name}-{len(self.pods)}")
        self.pods.append(p)
        return p.start()

    def arena_file(self) -> str:
        found = glob.glob(os.path.join(self.node.path(self.cfg["arena_dir"]), "*.host"))
        assert len(found) == 1, f"host arena files on the node: {found}"
        return found[0]

    def close(self) -> None:
        try:
            for p in reversed(self.pods):
                p.kill()
        finally:
            self.node.close()


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """get(overlay): a node with a running daemon for that overlay (one node serves every
    overlay whose daemon pod is the same)."""
    made: dict[str, Cluster] = {}

    def get(overlay: str) -> Cluster:
        if overlay in made:
            return made[overlay]
        c = Cluster(overlay, tmp_path_factory.mktemp(f"pods-{overlay}"))
        other = next((o for o in made.values()
                      if replace(o.daemon_spec, source="") == replace(c.daemon_spec, source="")), None)
        if other is not None:
            c.share(other)
        else:
            try:
                c.start_daemon()
            except BaseException:
                c.close()
                raise
        made[overlay] = c
        return c

    try:
        yield get
    finally:
        for c in made.values():
            c.close()     # (a node shared by several: closed by the first, then a no-op)


def _ns():
    from tierd import Namespace
    return Namespace(**podsim.NS_FIELDS)


def _expected_sha256(seed: int, n: int) -> list[str]:
    ns = _ns()
    return [hashlib.sha256(podsim.block_bytes_for(k, ns.block_bytes)).hexdigest()
            for k in podsim.chain_keys(seed, n)]


def _host_root_options() -> list[str]:
    opts = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[4] == "/":
                opts = parts[5].split(",")
    return opts


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_engine_pod_stores_and_loads_exact_bytes_through_the_nodes_socket_and_arena(clusters, overlay):
    if overlay != "vllm" and not (podsim.KUSTOMIZE / "overlays" / overlay).exists() and not REQUIRE:
        pytest.skip(f"no deploy/kubernetes/overlays/{overlay}")
    c = clusters(overlay)
    spec = c.engine_spec.main
    sock, arena_dir = c.cfg["socket"], c.cfg["arena_dir"]
    sock_dir = os.path.dirname(sock)
    # the manifests agree with each other: the engine joins a group the daemon admits, and
    # mounts the socket's and the arena's directories at the daemon's paths
    assert set(spec.groups) & set(c.cfg["allowed_gids"]), (spec.groups, c.cfg["allowed_gids"])
    assert c.url == f"unix://{sock}"
    for d in (sock_dir, arena_dir):
        m, dm = spec.mount_at(d), c.daemon_spec.main.mount_at(d)
        assert m is not None and dm is not None and m.volume.host_path == dm.volume.host_path, d

    e = c.engine(name=f"{overlay}-engine")
    who = e.ok("whoami", paths=["/", sock_dir, arena_dir], write=["/tmp", str(podsim.ROOT), "/"])
    # the pod is what its manifest says, and what it sees is the node's
    assert (who["uid"], who["gid"], who["groups"]) == (spec.uid, spec.gid, sorted(spec.groups))
    assert who["no_new_privs"] == "1" and int(who["cap_eff"], 16) == 0
    assert who["readonly"]["/"] is True
    assert who["write"]["/"] == who["write"][str(podsim.ROOT)] == "Read-only file system"
    # /tmp: writable where the manifest mounts an emptyDir there, else the image's (read-only)
    assert (who["write"]["/tmp"] == "ok") == (spec.mount_at("/tmp") is not None), who["write"]
    assert "ro" in c.daemon.mounts()["/"], "the daemon's pod sees the root read-write"
    assert "rw" in _host_root_options(), "this machine's root must stay writable (pods remount their own)"
    for d in (sock_dir, arena_dir):
        st = os.stat(c.node.path(d))
        assert who["stat"][d][:2] == [st.st_dev, st.st_ino], f"the engine's {d} is not the node's"
    st = os.stat(c.node.path(sock))
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == int(str(c.cfg["socket_mode"]), 8)
    assert (st.st_uid, st.st_gid) == (c.daemon_spec.main.uid, c.daemon_spec.main.gid)

    e.ok("connect", url=c.url)
    seed = 1 + OVERLAYS.index(overlay)
    assert e.ok("put", seed=seed, n=8)["stored"] == 8
    r = e.ok("read", seed=seed, n=8)
    assert r["lookup"] == 8 and r["where"] == ["host"] * 8 and r["lease_tiers"] == ["host"] * 8
    assert r["lease_equal"] == [True] * 8          # read in place, in the engine's mapping of the arena
    assert r["get_sha256"] == _expected_sha256(seed, 8)
    # zero copy across the pods: the bytes the engine wrote lie in the node's arena file
    ns = _ns()
    with open(c.arena_file(), "rb") as f:
        data = f.read()
    missing = [k.hex() for k in podsim.chain_keys(seed, 8) if podsim.block_bytes_for(k, ns.block_bytes) not in data]
    assert not missing, f"blocks not in the node's arena file: {missing}"


def _refused(c: Cluster, main: podsim.Container, name: str) -> dict:
    e = c.engine(main, name=name)
    try:
        r = e.call("connect", timeout_s=60, url=c.url)
    finally:
        e.kill()
    assert "error" in r, f"{name}: connected, and should not have: {r}"
    assert r["elapsed_s"] < NO_HANG_S, f"{name}: took {r['elapsed_s']:.1f}s to fail"
    print(f"{name}: {r['error']['type']}: {r['error']['message']} ({r['elapsed_s']:.2f}s)")
    return r["error"]


def test_an_engine_pod_without_the_socket_mount_hears_that_the_socket_is_missing(clusters):
    c = clusters("vllm")
    sock = c.cfg["socket"]
    err = _refused(c, c.engine_spec.main.without_mount(os.path.dirname(sock)), "no-socket-mount")
    assert err["type"] == "DaemonUnavailableError"
    assert sock in err["message"] and "No such file or directory" in err["message"]


def test_an_engine_pod_without_the_arena_mount_hears_which_arena_it_cannot_map(clusters):
    c = clusters("vllm")
    arena_dir = c.cfg["arena_dir"]
    err = _refused(c, c.engine_spec.main.without_mount(arena_dir), "no-arena-mount")
    assert err["type"] == "DaemonUnavailableError"
    assert "host arena" in err["message"] and os.path.join(arena_dir, "tierd-") in err["message"]
    assert "No such file or directory" in err["message"]


def test_an_engine_pod_outside_the_daemons_group_is_refused_with_the_reason(clusters):
    c = clusters("vllm")
    main = c.engine_spec.main
    # no supplementalGroups: the socket directory (0750, group 10001) keeps it out
    err = _refused(c, replace(main, groups=(main.gid,)), "no-group")
    assert err["type"] == "DaemonUnavailableError"
    assert c.cfg["socket"] in err["message"] and "Permission denied" in err["message"]
    assert str(main.uid) in err["message"]


def test_a_peer_past_the_socket_mode_but_not_allowed_is_refused_by_the_daemon_with_the_reason(clusters):
    """Past the file modes (CAP_DAC_OVERRIDE, which no engine pod here has) the daemon's own
    check (allowed_uids / allowed_gids, by SO_PEERCRED and SO_PEERGROUPS) still refuses, and
    says why."""
    c = clusters("vllm")
    outsider = replace(c.engine_spec.main, uid=10003, gid=10003, groups=(10003,),
                       ambient=frozenset({"dac_override"}))
    assert 10003 not in c.cfg["allowed_uids"] and 10003 not in c.cfg["allowed_gids"]
    err = _refused(c, outsider, "outsider")
    assert err["type"] == "ForbiddenError"
    assert "allowed_uids" in err["message"] and "allowed_gids" in err["message"]
    assert "10003" in err["message"]


def _recorded(e: EnginePod, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while e.ok("stats")["tiers"]["host"].get("keep_pending", 0):
        assert time.monotonic() < deadline, "host block records still pending"
        time.sleep(0.05)


def test_a_replaced_daemon_pod_serves_the_host_tier_again_and_the_engine_reconnects(tmp_path):
    c = Cluster("vllm", tmp_path)
    try:
        assert c.cfg["host_keep"] is True, "the DaemonSet's config must keep the host tier ([host] keep)"
        old = c.start_daemon()
        e = c.engine()
        client = e.ok("connect", url=c.url)["client_id"]
        assert e.ok("put", seed=3, n=12)["stored"] == 12
        assert e.ok("read", seed=3, n=12)["lease_equal"] == [True] * 12
        _recorded(e)
        arena = c.arena_file()
        # the kubelet stops the pod: SIGTERM to its process; then a new pod, in new
        # namespaces, on the same node (its init container runs again)
        old_pid = old.main_pid()
        assert old.terminate() == 0, old.log_tail()
        assert os.path.exists(arena), "the stopped daemon removed the host arena ([host] keep)"
        assert not os.path.exists(c.node.path(c.cfg["socket"]))
        new = c.start_daemon()
        assert new.main_pid() != old_pid and not old.alive()
        assert c.arena_file() == arena
        # the engine's same client reconnects by itself, and the blocks are host blocks again
        r = e.ok("read", seed=3, n=12)
        assert r["client_id"] == client and r["reconnects"] >= 1
        # (in host RAM, the new daemon's adopted blocks; on disk too: sync_on_stop wrote them)
        assert r["lookup"] == 12 and all("host" in w.split("+") for w in r["where"]), r["where"]
        assert r["lease_tiers"] == ["host"] * 12
        assert r["lease_equal"] == [True] * 12 and r["get_sha256"] == _expected_sha256(3, 12)
        host = e.ok("stats")["tiers"]["host"]
        assert host["adopted_blocks"] == 12 and host["adopt_dropped"] == 0, host
        # and it stores through the new daemon
        assert e.ok("put", seed=4, n=3)["stored"] == 3
        assert e.ok("read", seed=4, n=3)["get_sha256"] == _expected_sha256(4, 3)
    finally:
        c.close()

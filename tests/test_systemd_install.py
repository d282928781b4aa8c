"""systemd/install.sh as README.md ("Running as a service") documents it, run as far as a machine
without a booted systemd allows and without changing that machine.

`test_install_under_root` stages the install under a directory (`--root`). The main test runs the
script for real inside a private mount namespace, where every directory it writes (/etc, /opt,
/usr, /var, /run) is an overlay whose changes live in a tmpfs, and /dev/shm a tmpfs of its own;
the namespaces (mounts, pids) and all of it vanish with the driver process. There it checks what the script made
(user, directories, modes, unit, docs, config), `systemd-analyze verify` on the installed unit,
then starts the daemon the way systemd would: the unit's ExecStart= command line, User=, Group=,
UMask=, limits and environment (RuntimeDirectory=, StateDirectory=, NOTIFY_SOCKET), with small
sizes from TIERD_* variables. An engine user in group tierd pings it and puts and gets blocks
through the shared arena; a user outside the group is refused; SIGTERM stops it cleanly; a
restart re-adopts the host tier; the unit's ExecStopPost= keeps the arena on a restart job and
removes it on a stop job (with a stub `systemctl`); a second run of the script keeps the edited
config and sets its mode again; a third, with a disk tier larger than its filesystem, refuses and
names the setting to lower.

The venv is made from Debian's /usr/bin/python3 as on a fresh machine (the repo's interpreter
lives under /root, mode 0700: the service user could not run it). tierd goes in from a wheel
built from the checkout; its dependencies come, offline, from this checkout's venv through a
.pth file in the namespace's system site directory (`--system-site-packages`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "systemd" / "install.sh"
PIP_ARGS = "--no-index --no-deps"
OVERLAID = ("/etc", "/opt", "/usr", "/var", "/run")   # every directory install.sh writes under
ENGINE = "tierd-engine"                               # an engine's user, member of group tierd
TIERD = "/usr/local/bin/tierd"                        # the operators' link install.sh makes
# TIERD_TEST_INSTALL_ONLINE=1: pip takes the dependencies from the package index (slow, needs the
# network) instead of this checkout's venv
ONLINE = os.environ.get("TIERD_TEST_INSTALL_ONLINE") == "1"


# -- helpers shared by both sides ------------------------------------------------------------

def build_wheel(out: Path) -> Path:
    """A wheel of the checkout as it is now, built from a copy (no build/ in the checkout)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("tierd", "kernels", "connectors"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(out / "wheels"), str(src)],
                   check=True, capture_output=True, timeout=180)
    shutil.rmtree(src)
    (wheel,) = (out / "wheels").glob("tierd-*.whl")
    return wheel


def unit_settings(path: str) -> dict[str, list[str]]:
    """The [Service] and [Unit] settings of a unit file: name -> values, in order."""
    out: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def command_line(value: str, unit_name: str = "tierd.service") -> tuple[str, list[str]]:
    """An Exec*= value as systemd runs it: (prefixes, argv) with %n, %% and $$ resolved."""
    prefixes = ""
    while value and value[0] in "-+@:!":
        prefixes += value[0]
        value = value[1:]
    value = value.replace("%%", "\0").replace("%n", unit_name).replace("\0", "%")
    return prefixes, [a.replace("$$", "$") for a in shlex.split(value)]


def ids(db: str, name: str) -> tuple[int, int | None] | None:
    """(id, gid-or-None) of `name` in /etc/passwd or /etc/group, read directly (no NSS cache)."""
    for line in Path(f"/etc/{db}").read_text().splitlines():
        f = line.split(":")
        if f[0] == name:
            return int(f[2]), int(f[3]) if db == "passwd" else None
    return None


def debian_python() -> str | None:
    """/usr/bin/python3 when it can make a venv and matches this interpreter's version (the
    dependencies come from this venv's site-packages)."""
    py = "/usr/bin/python3"
    if not os.access(py, os.X_OK):
        return None
    r = subprocess.run([py, "-c", "import sys, venv, ensurepip; print(sys.version_info[:2])"],
                       capture_output=True, text=True)
    return py if r.returncode == 0 and r.stdout.strip() == str(tuple(sys.version_info[:2])) else None


def world_reachable(path: str) -> bool:
    p = Path(path)
    return all(os.stat(d).st_mode & stat.S_IXOTH for d in [p, *p.parents])


# -- pytest side -----------------------------------------------------------------------------

if __name__ != "__main__":
    import pytest

    def _why_not() -> str | None:
        if os.geteuid() != 0:
            return "needs root (a private mount namespace, users, chown)"
        for tool in ("unshare", "mount", "runuser", "useradd", "systemd-sysusers", "systemd-tmpfiles",
                     "systemd-analyze"):
            if shutil.which(tool) is None:
                return f"no {tool}"
        if debian_python() is None:
            return f"no /usr/bin/python3 {sys.version_info[0]}.{sys.version_info[1]} with venv and ensurepip"
        if not world_reachable(sysconfig.get_paths()["purelib"]):
            return "this venv's site-packages is not readable by other users"
        if "overlay" not in Path("/proc/filesystems").read_text() or not Path("/opt").is_dir():
            return "no overlayfs, or no /opt"
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                            "--mount-proc", "true"], capture_output=True)
        if r.returncode != 0:
            return f"unshare --mount fails here: {r.stderr.decode().strip()}"
        return None

    @pytest.fixture(scope="module")
    def wheel(tmp_path_factory):
        why = _why_not()
        if why is not None:
            pytest.skip(why)
        return build_wheel(tmp_path_factory.mktemp("wheel"))

    def test_install_under_root(wheel, tmp_path):
        """--root stages everything under a directory and changes nothing outside it."""
        root = tmp_path / "root"
        root.mkdir()
        before = {p: Path(p).read_bytes() for p in ("/etc/passwd", "/etc/group")}
        host_paths = ("/opt/tierd", "/etc/tierd", "/usr/local/bin/tierd", "/etc/systemd/system/tierd.service",
                      "/dev/shm/tierd", "/etc/sysusers.d/tierd.conf", "/etc/tmpfiles.d/tierd.conf")
        existed = {p: os.path.lexists(p) for p in host_paths}
        r = subprocess.run([str(SCRIPT), "--root", str(root), "--from", str(wheel), "--pip-args", PIP_ARGS],
                           capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stdout + r.stderr
        assert {p: Path(p).read_bytes() for p in before} == before
        assert {p: os.path.lexists(p) for p in host_paths} == existed
        passwd = {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines()}
        group = {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/group").read_text().splitlines()}
        uid, gid = int(passwd["tierd"][2]), int(group["tierd"][2])
        st = (root / "etc/tierd/tierd.toml").stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o640, 0, gid)
        assert f"allowed_gids = [{gid}]" in (root / "etc/tierd/tierd.toml").read_text()
        for d in ("dev/shm/tierd", "var/lib/tierd", "var/lib/tierd/disk"):
            st = (root / d).stat()
            assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o750, uid, gid), d
        unit = unit_settings(str(root / "etc/systemd/system/tierd.service"))
        _, argv = command_line(unit["ExecStart"][0])
        assert argv[0] == "/opt/tierd/bin/tierd" and (root / argv[0][1:]).exists()
        assert (root / unit["Documentation"][0].removeprefix("file:///")).is_file()
        assert os.readlink(root / "usr/local/bin/tierd") == "/opt/tierd/bin/tierd"
        assert (root / "etc/sysusers.d/tierd.conf").is_file() and (root / "etc/tmpfiles.d/tierd.conf").is_file()
        assert "systemctl daemon-reload && systemctl enable --now tierd" in r.stdout

    @pytest.mark.timeout(960 if ONLINE else 300)
    def test_install_and_serve_in_private_namespace(wheel, tmp_path):
        t0 = time.monotonic()
        # a pid namespace too: when the driver ends, however it ends, the kernel ends every
        # process it started (the daemon), and the mount namespace goes with them
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                            "--mount-proc", sys.executable, __file__, str(wheel), str(tmp_path),
                            sysconfig.get_paths()["purelib"]],
                           capture_output=True, text=True, timeout=900 if ONLINE else 280)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-12000:]
        assert "ALL CHECKS PASSED" in r.stdout, out[-12000:]
        print(r.stdout[-6000:])
        print(f"namespace run: {time.monotonic() - t0:.1f}s")


# -- inside the private mount namespace (python tests/test_systemd_install.py WHEEL TMP DEPS) ---

def sh(*argv: str, ok: bool = True, user: str | None = None, **kw) -> subprocess.CompletedProcess:
    if user is not None:
        argv = ("runuser", "-u", user, "--", *argv)
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=kw.pop("timeout", 180), **kw)
    if ok and r.returncode != 0:
        raise AssertionError(f"{argv} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def mode_owner(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid


def private_mounts(tmp: Path) -> None:
    """Overlays over every directory the script writes, changes kept in a tmpfs; a fresh /dev/shm."""
    work = tmp / "overlays"
    work.mkdir()
    sh("mount", "-t", "tmpfs", "-o", "size=1g,mode=0700", "tierd-test", str(work))
    for i, d in enumerate(OVERLAID):
        (work / f"u{i}").mkdir()
        (work / f"w{i}").mkdir()
        sh("mount", "-t", "overlay", "overlay", "-o",
           f"lowerdir={d},upperdir={work}/u{i},workdir={work}/w{i}", d)
    # systemd's own size of /dev/shm (a limit: pages are taken only as files fill)
    sh("mount", "-t", "tmpfs", "-o", "size=50%,mode=1777,nosuid,nodev", "tierd-test-shm", "/dev/shm")
    mounts = {ln.split()[1]: ln.split()[2] for ln in Path("/proc/self/mounts").read_text().splitlines()}
    assert all(mounts.get(d) == "overlay" for d in OVERLAID) and mounts.get("/dev/shm") == "tmpfs", mounts
    # as on a fresh machine: what earlier runs of tierd on this host left (e.g. /var/lib/tierd of a
    # daemon run as root) is hidden; removing it in the overlay only whites it out
    for d in ("/etc/tierd", "/opt/tierd", "/var/lib/tierd", "/run/tierd", "/usr/local/bin/tierd",
              "/etc/systemd/system/tierd.service", "/etc/sysusers.d/tierd.conf", "/etc/tmpfiles.d/tierd.conf"):
        if os.path.lexists(d):
            print(f"hiding the host's {d}")
            sh("rm", "-rf", "--one-file-system", d)


class Daemon:
    """`tierd serve` started as systemd starts the installed unit."""

    def __init__(self, unit: dict[str, list[str]], tmp: Path):
        self.unit, self.tmp = unit, tmp
        self.proc: subprocess.Popen | None = None

    def start(self) -> list[str]:
        unit = self.unit
        _, argv = command_line(unit["ExecStart"][0])
        user, group = unit["User"][0], unit["Group"][0]
        uid, _ = ids("passwd", user)
        gid, _ = ids("group", group)
        # RuntimeDirectory=tierd, RuntimeDirectoryMode=
        run = Path("/run") / unit["RuntimeDirectory"][0]
        run.mkdir(exist_ok=True)
        os.chmod(run, int(unit["RuntimeDirectoryMode"][0], 8))
        os.chown(run, uid, gid)
        notify_dir = Path("/run/tierd-test-notify")
        notify_dir.mkdir(mode=0o755, exist_ok=True)
        addr = notify_dir / "notify"
        addr.unlink(missing_ok=True)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(addr))
        os.chmod(addr, 0o666)
        pw = next(ln.split(":") for ln in Path("/etc/passwd").read_text().splitlines() if ln.startswith(user + ":"))
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin", "LANG": "C.UTF-8",
               "USER": user, "LOGNAME": user, "HOME": pw[5], "SHELL": pw[6], "INVOCATION_ID": os.urandom(16).hex(),
               "RUNTIME_DIRECTORY": str(run), "STATE_DIRECTORY": "/var/lib/" + unit["StateDirectory"][0],
               "NOTIFY_SOCKET": str(addr),
               "WATCHDOG_USEC": str(int(float(unit["WatchdogSec"][0]) * 1_000_000))}
        for value in unit.get("Environment", []):
            for assignment in shlex.split(value):
                k, _, v = assignment.partition("=")
                env[k] = v
        # small sizes for the test machine (the config's are fractions of a real node)
        env.update(TIERD_HOST_BYTES="64MiB", TIERD_DISK_BYTES="64MiB", TIERD_DISK_SLAB_BYTES="16MiB",
                   TIERD_DISK_FILE_BYTES="64MiB", TIERD_METRICS_ADDR="127.0.0.1:0")
        import grp
        import resource
        for name, lim in (("LimitNOFILE", resource.RLIMIT_NOFILE), ("LimitMEMLOCK", resource.RLIMIT_MEMLOCK)):
            want = resource.RLIM_INFINITY if unit[name][0] == "infinity" else int(unit[name][0])
            try:
                resource.setrlimit(lim, (want, want))
            except (ValueError, OSError):   # a container's root may not raise its hard limits
                hard = resource.getrlimit(lim)[1]
                low = want if hard == resource.RLIM_INFINITY or (want != resource.RLIM_INFINITY and want <= hard) else hard
                resource.setrlimit(lim, (low, hard))
                print(f"{name}={unit[name][0]}: this machine allows {low} only")
        self.log = open(self.tmp / "daemon.log", "ab")
        self.proc = subprocess.Popen(argv, env=env, cwd="/", user=uid, group=gid,
                                     extra_groups=[g.gr_gid for g in grp.getgrall() if user in g.gr_mem],
                                     umask=int(unit["UMask"][0], 8), stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=self.log)
        msgs = self.wait_notify("READY=1", 60)
        assert self.proc.poll() is None
        return msgs

    def wait_notify(self, what: str, timeout_s: float) -> list[str]:
        deadline = time.monotonic() + timeout_s
        got = []
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and what != "STOPPING=1":
                break
            self.notify.settimeout(0.2)
            try:
                got.append(self.notify.recv(4096).decode())
            except socket.timeout:
                continue
            if any(what in m.split("\n") for m in got):
                return got
        raise AssertionError(f"no {what} from the daemon (exit {self.proc.poll()}), got {got}:\n{self.log_text()}")

    def stop(self, timeout_s: float) -> int:
        self.proc.send_signal(signal.SIGTERM)
        self.wait_notify("STOPPING=1", timeout_s)
        rc = self.proc.wait(timeout_s)
        self.notify.close()
        self.log.close()
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
            self.log.close()

    def log_text(self) -> str:
        return (self.tmp / "daemon.log").read_text(errors="replace")[-4000:]


ENGINE_PUT = r"""
import json, sys, numpy as np, tierd
ns = tierd.Namespace(model="systemd-test", kv_dtype="float16", num_layers=2, num_kv_heads=2, head_dim=64,
                     block_tokens=16)
keys = ns.block_keys(np.arange(3 * 16, dtype=np.int32))
blocks = [np.full(ns.block_bytes, i + 1, np.uint8) for i in range(len(keys))]
c = tierd.connect("unix:///run/tierd/tierd.sock")
if sys.argv[1] == "put":
    assert c.put(ns, keys, blocks) == len(keys)
got = c.get(ns, keys)
assert len(got) == len(keys) and all(np.array_equal(g, b) for g, b in zip(got, blocks)), "blocks differ"
print(json.dumps({"where": c.where(ns, keys)}))
c.close()
"""


def inside(wheel: str, tmp: Path, deps: str) -> None:
    private_mounts(tmp)
    if ONLINE:   # the dependencies from the package index, as an operator's install gets them
        install_args = ("--from", wheel)
    else:
        py_minor = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        site = Path(f"/usr/local/lib/{py_minor}/dist-packages")
        site.mkdir(parents=True, exist_ok=True)
        (site / "tierd-test-deps.pth").write_text(deps + "\n")
        install_args = ("--from", wheel, "--system-site-packages", "--pip-args", PIP_ARGS)

    # 1. the documented install
    r = sh(str(SCRIPT), *install_args, timeout=600)
    print(r.stdout)
    assert "systemctl daemon-reload && systemctl enable --now tierd" in r.stdout
    assert "free for it" in r.stdout and "warning" not in r.stdout, r.stdout   # the arena fits
    assert re.search(r"disk tier \S+ \(\[disk\] bytes = .*\) in /var/lib/tierd/disk: .* free for it", r.stdout), r.stdout
    uid, ugid = ids("passwd", "tierd")
    gid, _ = ids("group", "tierd")
    assert ugid == gid
    unit_path = "/etc/systemd/system/tierd.service"
    unit = unit_settings(unit_path)
    assert unit["User"] == ["tierd"] and unit["Group"] == ["tierd"]

    # 2. what it made
    config = "/etc/tierd/tierd.toml"
    assert mode_owner(config) == (0o640, 0, gid), mode_owner(config)
    assert sh("cat", config, user="tierd").stdout == Path(config).read_text()
    assert sh("cat", config, user="nobody", ok=False).returncode != 0, "the config is world-readable"
    assert f"allowed_gids = [{gid}]" in Path(config).read_text()
    arena_dir = next(ln.split('"')[1] for ln in Path(config).read_text().splitlines()
                     if ln.startswith("arena_dir"))
    for d in (arena_dir, "/var/lib/tierd", "/var/lib/tierd/disk"):
        assert mode_owner(d) == (0o750, uid, gid), (d, mode_owner(d))
    assert arena_dir in " ".join(unit["ReadWritePaths"]), "arena_dir is not in ReadWritePaths= (ProtectSystem=strict)"
    _, argv = command_line(unit["ExecStart"][0])
    assert os.access(argv[0], os.X_OK) and argv[1:] == ["serve", "--config", config], argv
    assert sh(argv[0], "--version", user="tierd").stdout.startswith("tierd ")
    doc = unit["Documentation"][0].removeprefix("file://")
    assert Path(doc).is_file(), f"Documentation= names {doc}, which is not there"
    assert os.path.realpath("/usr/local/bin/tierd") == os.path.realpath(argv[0])
    r = sh("systemd-analyze", "verify", "--man=no", unit_path, ok=False)
    assert r.returncode == 0 and "tierd.service" not in r.stdout + r.stderr, r.stdout + r.stderr

    # 3. an engine's user joins group tierd, as the docs say
    sh("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", "tierd", ENGINE)

    # 4. the daemon as systemd would start it
    daemon = Daemon(unit, tmp)
    try:
        msgs = daemon.start()
        assert any(f"MAINPID={daemon.proc.pid}" in m for m in msgs), msgs
        sock = "/run/tierd/tierd.sock"
        assert mode_owner(sock)[0] == 0o660 and mode_owner(sock)[1:] == (uid, gid), mode_owner(sock)
        assert sh(TIERD, "ping").returncode == 0   # the operator, as root, by the default socket
        assert sh(TIERD, "ping", "--socket", sock, user=ENGINE).returncode == 0
        refused = sh(TIERD, "ping", "--socket", sock, user="nobody", ok=False)
        assert refused.returncode != 0, "a user outside group tierd reached the daemon"
        where = json.loads(sh(f"{os.path.dirname(argv[0])}/python", "-c", ENGINE_PUT, "put",
                              user=ENGINE).stdout)["where"]
        assert where == ["host"] * 3, where
        stats = json.loads(sh(TIERD, "stats", "--json").stdout)
        assert stats["tiers"]["host"]["capacity_bytes"] == 64 << 20, stats["tiers"]["host"]
        assert stats["tiers"]["host"]["blocks"] == 3 and stats["tiers"]["disk"]["path"] == "/var/lib/tierd/disk"
        arena = sorted(os.listdir(arena_dir))
        assert any(n.endswith(".host") for n in arena), arena
        assert daemon.stop(60) == 0, daemon.log_text()
        assert not os.path.exists(sock), "the socket outlived the daemon"
        kept = sorted(os.listdir(arena_dir))
        assert any(n.endswith(".host") for n in kept), f"[host] keep left no arena: {kept}"

        # 5. a restart re-adopts the host tier from /dev/shm/tierd
        daemon = Daemon(unit, tmp)
        daemon.start()
        where = json.loads(sh(f"{os.path.dirname(argv[0])}/python", "-c", ENGINE_PUT, "get",
                              user=ENGINE).stdout)["where"]
        # host: re-adopted from the arena; +disk: sync_on_stop wrote them down at the stop
        assert [w.split("+")[0] for w in where] == ["host"] * 3, f"not re-adopted: {where}\n{daemon.log_text()}"
        stats = json.loads(sh(TIERD, "stats", "--json").stdout)
        assert stats["tiers"]["host"]["adopted_blocks"] == 3, stats["tiers"]["host"]
        assert daemon.stop(60) == 0, daemon.log_text()
        kept = sorted(os.listdir(arena_dir))
    finally:
        daemon.kill()

    # 6. ExecStopPost=: a restart job keeps the arena, a stop job removes it
    stub = tmp / "stub"
    stub.mkdir()
    (stub / "systemctl").write_text('#!/bin/sh\necho "42 tierd.service $JOB running"\n')
    os.chmod(stub / "systemctl", 0o755)
    (post,) = unit["ExecStopPost"]
    prefixes, post_argv = command_line(post)
    assert "+" in prefixes, "ExecStopPost= must run as root to remove the daemon's files"
    path = f"{stub}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    sh(*post_argv, env={"PATH": path, "JOB": "restart"})
    assert sorted(os.listdir(arena_dir)) == kept, "ExecStopPost= removed the arena on a restart"
    sh(*post_argv, env={"PATH": path, "JOB": "stop"})
    assert os.listdir(arena_dir) == [], f"ExecStopPost= left {os.listdir(arena_dir)} after a stop"
    assert os.path.isdir(arena_dir)

    # 7. run again: idempotent, the operator's config kept, its owner and mode set again
    with open(config, "a") as f:
        f.write("# edited by the operator\n")
    os.chown(config, 0, 0)
    unit_before = Path(unit_path).read_bytes()
    r = sh(str(SCRIPT), "--from", wheel, *(() if ONLINE else ("--pip-args", PIP_ARGS)), timeout=600)
    assert "kept" in r.stdout and "warning" not in r.stdout, r.stdout
    assert Path(config).read_text().endswith("# edited by the operator\n")
    assert mode_owner(config) == (0o640, 0, gid)
    assert Path(unit_path).read_bytes() == unit_before
    assert sh(TIERD, "--version", user="tierd").returncode == 0

    # 8. a tier its filesystem has no room for: refused, with the setting to lower and the numbers
    text = Path(config).read_text()
    Path(config).write_text(re.sub(r'(?m)^bytes = "10%"', 'bytes = "4096TiB"', text, count=1))
    r = sh(str(SCRIPT), "--from", wheel, *(() if ONLINE else ("--pip-args", PIP_ARGS)), ok=False, timeout=600)
    assert r.returncode != 0, r.stdout + r.stderr
    assert re.search(r"the disk tier needs 4096TiB \(\[disk\] bytes = \"4096TiB\"\) in /var/lib/tierd/disk, "
                     r"which has \S+ free for it .* lower \[disk\] bytes in /etc/tierd/tierd.toml to at most \S+",
                     r.stderr), r.stdout + r.stderr
    Path(config).write_text(text)
    print("ALL CHECKS PASSED")


if __name__ == "__main__":
    inside(sys.argv[1], Path(sys.argv[2]), sys.argv[3])

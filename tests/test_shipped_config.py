"""The shipped configs (systemd/tierd.toml, deploy/kubernetes/base/tierd.toml) start on a small
machine, and install.sh's step 8 checks every tier's room where the config puts it.

The disk tier's slab files are reserved whole at start, so a fixed size larger than the disk
(the former "200GiB") refused every start on a machine with less free space. A machine is
faked for the paths of one test only (`small_machine`): its filesystem's size and free space, as
`os.statvfs` reports them to the size parser and to the disk tier."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tierd import TieredStore
from tierd.config import GiB, MiB, TiB, load_serve_config, parse_size
from tierd.errors import DiskTierError

from .helpers import assert_exact, chain, make_ns, put_chain

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "systemd" / "tierd.toml"
KUBERNETES = ROOT / "deploy" / "kubernetes" / "base" / "tierd.toml"
INSTALL = ROOT / "systemd" / "install.sh"


def small_machine(monkeypatch, under: Path, size: int, free: int) -> None:
    """statvfs of every path under `under`: a filesystem of `size` bytes with `free` available."""
    real = os.statvfs

    class Small:
        f_frsize = f_bsize = 4096
        f_blocks, f_bfree, f_bavail = size // 4096, free // 4096, free // 4096

    monkeypatch.setattr(os, "statvfs", lambda p: Small() if str(p).startswith(str(under)) else real(p))


def shipped(path: Path, disk_path: Path):
    """The shipped config with the disk tier at `disk_path`, as `tierd serve` reads it."""
    return load_serve_config(str(path), flags={"disk.path": str(disk_path)}, env={})


@pytest.mark.parametrize("config", [SYSTEMD, KUBERNETES], ids=["systemd", "kubernetes"])
@pytest.mark.parametrize("size,free", [(32 * GiB, 8 * GiB), (256 * GiB, 52 * GiB), (4 * TiB, 3 * TiB)],
                         ids=["32GiB-disk", "review-machine", "nvme"])
def test_the_shipped_disk_size_fits_the_free_space_of_a_small_machine(monkeypatch, tmp_path, config, size, free):
    small_machine(monkeypatch, tmp_path, size, free)
    cfg = shipped(config, tmp_path / "disk")
    disk = cfg.store.resolved().disk_bytes
    assert 1 * GiB <= disk <= free // 2, (cfg.store.disk_bytes, disk, free)


@pytest.mark.parametrize("config", [SYSTEMD, KUBERNETES], ids=["systemd", "kubernetes"])
def test_the_shipped_disk_settings_start_a_disk_tier_that_keeps_its_blocks(monkeypatch, tmp_path, config):
    """The shipped [disk] settings, on a (faked) 64 MiB filesystem with 40 MiB free: the tier
    starts, takes blocks, and a restart serves them."""
    small_machine(monkeypatch, tmp_path, 64 * MiB, 40 * MiB)
    store_cfg = shipped(config, tmp_path / "disk").store
    store_cfg.host_bytes, store_cfg.host_keep = "4MiB", False   # the host tier is not the point here
    ns = make_ns()
    keys = [k for s in range(4) for k in chain(ns, s, 4)]
    with TieredStore(store_cfg) as s:
        st = s.stats()["tiers"]["disk"]
        assert st["capacity_bytes"] == parse_size("10%", total=64 * MiB), st
        put_chain(s, ns, keys)
        assert s.sync() == len(keys)
    with TieredStore(store_cfg) as s:
        assert s.stats()["tiers"]["disk"]["blocks"] == len(keys)
        assert_exact(s, ns, keys)


def test_a_disk_tier_with_no_room_is_refused_with_the_setting_and_the_numbers(monkeypatch, tmp_path):
    small_machine(monkeypatch, tmp_path, 64 * MiB, 40 * MiB)
    store_cfg = shipped(SYSTEMD, tmp_path / "disk").store
    store_cfg.host_bytes, store_cfg.host_keep, store_cfg.disk_bytes = "4MiB", False, "200GiB"
    with pytest.raises(DiskTierError) as e:
        TieredStore(store_cfg)
    msg = str(e.value)
    assert "cannot reserve 200.0GiB" in msg and "40MiB free" in msg and "lower disk.bytes" in msg, msg
    assert "to at most 40MiB" in msg, msg
    assert not (tmp_path / "disk").exists(), "a refused start leaves nothing behind"


# -- install.sh, step 8: the check as the service user runs it ---------------------------------

def room_check() -> str:
    """The Python program install.sh runs (as the service user) to check the config."""
    m = re.search(r"<<'PY' \|\| rc=\$\?\n(.*?)\nPY\n", INSTALL.read_text(), re.S)
    assert m, "install.sh has no room check"
    return m.group(1)


def run_check(tmp_path: Path, host: str, disk: str) -> subprocess.CompletedProcess:
    """install.sh's check of the shipped systemd config with its directories under tmp_path."""
    arena, dpath = tmp_path / "shm" / "tierd", tmp_path / "lib" / "tierd" / "disk"
    arena.mkdir(parents=True, exist_ok=True)
    dpath.parent.mkdir(parents=True, exist_ok=True)
    text = SYSTEMD.read_text()
    text = re.sub(r'(?m)^arena_dir = ".*?"', f'arena_dir = "{arena}"', text)
    text = re.sub(r'(?m)^path = "/var/lib/tierd/disk"', f'path = "{dpath}"', text)
    text = re.sub(r'(?m)^bytes = "25%"', f'bytes = "{host}"', text)
    text = re.sub(r'(?m)^bytes = "10%"', f'bytes = "{disk}"', text)
    config = tmp_path / "tierd.toml"
    config.write_text(text)
    return subprocess.run([sys.executable, "-", str(config)], input=room_check(), capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path)


def test_install_check_passes_the_shipped_config_and_names_both_tiers(tmp_path):
    r = run_check(tmp_path, "4MiB", "10%")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"host tier 4MiB \(\[host\] bytes = \"4MiB\"\) in \S+shm/tierd: .* free for it", r.stdout), r.stdout
    assert re.search(r"disk tier \S+ \(\[disk\] bytes = \"10%\", of its filesystem\) in \S+/disk: .* free for it",
                     r.stdout), r.stdout


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_install_check_refuses_a_tier_without_room_and_names_the_fix(tmp_path, tier):
    r = run_check(tmp_path, "4096TiB" if tier == "host" else "4MiB", "4096TiB" if tier == "disk" else "10%")
    assert r.returncode == 3, r.stdout + r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"the {tier} tier needs 4096TiB ([{tier}] bytes = \"4096TiB\")" in line, line
    assert f"lower [{tier}] bytes in {tmp_path / 'tierd.toml'} to at most" in line, line
    assert "run install.sh again" in line, line

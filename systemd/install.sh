#!/bin/sh
# Install tierd as a systemd service: run as root from a checkout, `sudo systemd/install.sh`.
# Idempotent: run it again to upgrade (the config is kept, its owner and mode set again).
#
# Steps, in order (README.md "Running as a service" and docs/operations.md list the same):
#  1. the service user and group tierd: SYSUSERS_D/tierd.conf, then systemd-sysusers
#     (useradd where there is no systemd-sysusers)
#  2. the directories /dev/shm/tierd (host arena), /var/lib/tierd and /var/lib/tierd/disk,
#     0750 tierd:tierd: TMPFILES_D/tierd.conf, then systemd-tmpfiles --create (install -d where
#     there is none); refused if /dev/shm/tierd exists and belongs to another user
#  3. the venv VENV (python3 -m venv, made once) and tierd in it (pip install)
#  4. the unit /etc/systemd/system/tierd.service (ExecStart=VENV/bin/tierd)
#  5. the docs the unit names, VENV/share/doc/tierd/operations.md, and the example config
#     beside it
#  6. /etc/tierd/tierd.toml, root:tierd 0640 (readable by the service user, by no one else),
#     with the gid of group tierd in allowed_gids (the daemon admits its own group anyway; the
#     line says so where operators look); an existing one is kept, only its owner and mode are set
#  7. the link /usr/local/bin/tierd -> VENV/bin/tierd, for operators (`tierd stats`)
#  8. checks: the service user can run VENV/bin/tierd and read the config; systemd-analyze
#     verify passes on the unit; every tier has room where the config puts it (the host arena
#     in arena_dir, the disk tier in [disk] path's filesystem), else it refuses and names the
#     setting to lower
#  9. prints what is left to do: systemctl daemon-reload && systemctl enable --now tierd
#
# SYSUSERS= TMPFILES= (empty) in the environment use useradd and install -d even where the
# systemd tools exist.
set -eu

usage() {
    cat <<'EOF'
usage: systemd/install.sh [options]
  --venv DIR              venv of tierd; the unit runs DIR/bin/tierd (default /opt/tierd)
  --from SRC              what pip installs: a wheel or sdist file, or a source directory (no
                          tierd is published on a package index yet). Default: the wheel
                          `make wheel` left in this checkout's dist/ (it records its commit),
                          else a wheel built here from the checkout
  --python PY             interpreter the venv is made with (default /usr/bin/python3, else
                          python3 on PATH); the service user must be able to run it
  --system-site-packages  the venv also sees PY's packages (dependencies installed by apt)
  --pip-args ARGS         more pip arguments, e.g. "--no-index --find-links /srv/wheels"
  --no-link               no /usr/local/bin/tierd link
  --root DIR              install under DIR instead of / (staging, tests): sysusers and tmpfiles
                          act on DIR, the venv is made at DIR/VENV (its scripts name that path),
                          and the checks as the service user are skipped
  -h, --help              this text
EOF
}

HERE=$(cd "$(dirname "$0")" && pwd)
CHECKOUT=$(dirname "$HERE")
VENV=/opt/tierd
SRC=
PY=
SYSTEM_SITE=
PIP_ARGS=
LINK=yes
ROOT=
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) VENV=${2:?--venv needs a directory}; shift 2 ;;
        --from) SRC=${2:?--from needs a source}; shift 2 ;;
        --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
        --system-site-packages) SYSTEM_SITE=--system-site-packages; shift ;;
        --pip-args) PIP_ARGS=${2?--pip-args needs arguments}; shift 2 ;;
        --no-link) LINK=; shift ;;
        --root) ROOT=${2:?--root needs a directory}; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
    esac
done

die() { echo "install.sh: $*" >&2; exit 1; }
step() { echo "==> $*"; }

[ "$(id -u)" -eq 0 ] || die "run as root (sudo $0)"
case "$VENV" in
    /home/*|/root|/root/*|/run/user/*|/tmp/*|/var/tmp/*)
        die "--venv $VENV: the unit's ProtectHome=/PrivateTmp= hide that directory from the daemon; use e.g. /opt/tierd" ;;
    *[!A-Za-z0-9/._-]*) die "--venv $VENV: use only letters, digits and / . _ - (the path goes into the unit)" ;;
    /*) ;;
    *) die "--venv $VENV: give an absolute path" ;;
esac
VENV=${VENV%/}
if [ -n "$ROOT" ]; then
    ROOT=$(cd "$ROOT" && pwd) || die "--root $ROOT: no such directory"
    [ "$ROOT" = / ] && ROOT=
fi
# what this script makes must be readable by the service user, whatever root's umask
umask 022

SYSUSERS_D=/etc/sysusers.d
TMPFILES_D=/etc/tmpfiles.d
UNIT=/etc/systemd/system/tierd.service
CONFIG=/etc/tierd/tierd.toml
DOCS=$VENV/share/doc/tierd
SYSUSERS=${SYSUSERS-$(command -v systemd-sysusers || true)}
TMPFILES=${TMPFILES-$(command -v systemd-tmpfiles || true)}
for f in tierd.service tierd.sysusers.conf tierd.tmpfiles.conf tierd.toml; do
    [ -f "$HERE/$f" ] || die "$HERE/$f is missing: run the script from a tierd checkout"
done
[ -f "$CHECKOUT/docs/operations.md" ] || die "$CHECKOUT/docs/operations.md is missing"

# uid or gid of NAME in DIR/etc/passwd or group (getent on the running system)
lookup_id() {  # passwd|group NAME; prints nothing when there is none
    if [ -z "$ROOT" ]; then
        getent "$1" "$2" | cut -d: -f3
    elif [ -f "$ROOT/etc/$1" ]; then
        awk -F: -v n="$2" '$1 == n { print $3; exit }' "$ROOT/etc/$1"
    fi
    return 0
}

step "1. service user: $SYSUSERS_D/tierd.conf"
install -d -m 0755 "$ROOT$SYSUSERS_D"
install -m 0644 "$HERE/tierd.sysusers.conf" "$ROOT$SYSUSERS_D/tierd.conf"
if [ -n "$SYSUSERS" ]; then
    echo "    systemd-sysusers $SYSUSERS_D/tierd.conf"
    "$SYSUSERS" ${ROOT:+--root="$ROOT"} "$ROOT$SYSUSERS_D/tierd.conf"
else
    # the file's u line: u NAME ID "GECOS" HOME
    line=$(grep '^u ' "$HERE/tierd.sysusers.conf" | head -n 1)
    name=$(echo "$line" | awk '{ print $2 }')
    home=$(echo "$line" | awk '{ print $NF }')
    gecos=$(echo "$line" | sed -n 's/^[^"]*"\([^"]*\)".*/\1/p')
    if [ -z "$(lookup_id passwd "$name")" ]; then
        echo "    useradd --system $name"
        useradd ${ROOT:+--prefix "$ROOT"} --system --user-group --home-dir "$home" --no-create-home \
            --shell /usr/sbin/nologin --comment "$gecos" "$name"
    fi
fi
TIERD_UID=$(lookup_id passwd tierd)
TIERD_GID=$(lookup_id group tierd)
[ -n "$TIERD_UID" ] && [ -n "$TIERD_GID" ] || die "user or group tierd was not created"

step "2. directories: $TMPFILES_D/tierd.conf"
# /dev/shm is writable by everyone: a /dev/shm/tierd made by another user could hold files the
# daemon would take for its own arena
if [ -e "$ROOT/dev/shm/tierd" ] || [ -L "$ROOT/dev/shm/tierd" ]; then
    owner=$(stat -c %u "$ROOT/dev/shm/tierd")
    if [ -L "$ROOT/dev/shm/tierd" ] || { [ "$owner" != 0 ] && [ "$owner" != "$TIERD_UID" ]; }; then
        die "$ROOT/dev/shm/tierd exists and belongs to uid $owner (or is a link), not to tierd:" \
            "remove it (rm -rf) and run again"
    fi
fi
install -d -m 0755 "$ROOT$TMPFILES_D"
install -m 0644 "$HERE/tierd.tmpfiles.conf" "$ROOT$TMPFILES_D/tierd.conf"
if [ -n "$TMPFILES" ]; then
    echo "    systemd-tmpfiles --create $TMPFILES_D/tierd.conf"
    "$TMPFILES" ${ROOT:+--root="$ROOT"} --create "$ROOT$TMPFILES_D/tierd.conf"
else
    grep '^d ' "$HERE/tierd.tmpfiles.conf" | while read -r _type path mode user group _age; do
        echo "    install -d -m $mode -o $user -g $group $path"
        install -d -m "$mode" -o "$(lookup_id passwd "$user")" -g "$(lookup_id group "$group")" "$ROOT$path"
    done
fi

step "3. venv $VENV and tierd in it"
if [ -z "$SRC" ]; then
    built=$(ls -t "$CHECKOUT"/dist/tierd-*-py3-none-any.whl 2>/dev/null | head -n 1)
    if [ -n "$built" ]; then SRC=$built
    elif [ -f "$CHECKOUT/pyproject.toml" ]; then SRC=$CHECKOUT
    else die "no source to install: run make wheel in the checkout, or give --from WHEEL"; fi
fi
if [ ! -x "$ROOT$VENV/bin/python" ]; then
    if [ -z "$PY" ]; then
        if [ -x /usr/bin/python3 ]; then PY=/usr/bin/python3
        else PY=$(command -v python3) || die "no python3: give --python"; fi
    fi
    "$PY" -c 'import venv, ensurepip' 2>/dev/null \
        || die "$PY cannot make a venv with pip (Debian/Ubuntu: apt install python3-venv)"
    echo "    $PY -m venv ${SYSTEM_SITE:+$SYSTEM_SITE }$VENV"
    "$PY" -m venv $SYSTEM_SITE "$ROOT$VENV"
elif [ -n "$PY" ] || [ -n "$SYSTEM_SITE" ]; then
    echo "    $VENV exists: kept as it is (--python, --system-site-packages apply to a new one; rm -rf $VENV to make it again)"
fi
pip() { "$ROOT$VENV/bin/python" -m pip --disable-pip-version-check --no-input "$@"; }
if [ -d "$SRC" ] && [ -f "$SRC/pyproject.toml" ]; then
    # a source directory: build its wheel once, then install that like a wheel
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    echo "    pip wheel --no-deps $SRC"
    # shellcheck disable=SC2086 # PIP_ARGS is a list of arguments
    pip wheel -q --no-deps $PIP_ARGS -w "$wheels" "$SRC"
    SRC=$(ls "$wheels"/tierd-*.whl) || die "pip built no tierd wheel from $SRC"
fi
echo "    pip install $SRC"
# shellcheck disable=SC2086
pip install -q --upgrade $PIP_ARGS "$SRC"
if [ -f "$SRC" ]; then
    # pip keeps an installed tierd of the same version as a local file: this one is newer
    # shellcheck disable=SC2086
    pip install -q --force-reinstall --no-deps $PIP_ARGS "$SRC"
fi
[ -x "$ROOT$VENV/bin/tierd" ] || die "pip installed no $VENV/bin/tierd"

step "4. unit $UNIT (ExecStart=$VENV/bin/tierd)"
install -d -m 0755 "$ROOT$(dirname "$UNIT")"
sed "s|/opt/tierd/|$VENV/|g" "$HERE/tierd.service" > "$ROOT$UNIT.tmp"
chmod 0644 "$ROOT$UNIT.tmp"
mv -f "$ROOT$UNIT.tmp" "$ROOT$UNIT"

step "5. docs $DOCS/operations.md"
install -d -m 0755 "$ROOT$DOCS"
install -m 0644 "$CHECKOUT/docs/operations.md" "$ROOT$DOCS/operations.md"
install -m 0644 "$HERE/tierd.toml" "$ROOT$DOCS/tierd.toml"

step "6. config $CONFIG (root:tierd 0640)"
[ -d "$ROOT$(dirname "$CONFIG")" ] || install -d -m 0755 "$ROOT$(dirname "$CONFIG")"
if [ -e "$ROOT$CONFIG" ]; then
    echo "    kept (compare with $DOCS/tierd.toml)"
    chown 0:"$TIERD_GID" "$ROOT$CONFIG"
    chmod 0640 "$ROOT$CONFIG"
    grep -Eq '^arena_dir *= *"/dev/shm/tierd/?"' "$ROOT$CONFIG" \
        || echo "    warning: arena_dir in $CONFIG is not /dev/shm/tierd, the directory the unit and tmpfiles.d/tierd.conf make room for"
else
    grep -q '^allowed_gids = \[\]' "$HERE/tierd.toml" || die "$HERE/tierd.toml has no 'allowed_gids = []' line"
    sed "s/^allowed_gids = \[\]/allowed_gids = [$TIERD_GID]/" "$HERE/tierd.toml" > "$ROOT$CONFIG.tmp"
    chown 0:"$TIERD_GID" "$ROOT$CONFIG.tmp"
    chmod 0640 "$ROOT$CONFIG.tmp"
    mv -f "$ROOT$CONFIG.tmp" "$ROOT$CONFIG"
    echo "    allowed_gids = [$TIERD_GID] (group tierd)"
fi

if [ -n "$LINK" ]; then
    step "7. link /usr/local/bin/tierd -> $VENV/bin/tierd"
    install -d -m 0755 "$ROOT/usr/local/bin"
    ln -sfn "$VENV/bin/tierd" "$ROOT/usr/local/bin/tierd"
else
    step "7. no link (--no-link)"
fi

step "8. checks"
if [ -n "$ROOT" ]; then
    echo "    skipped (--root)"
else
    as_tierd() {
        if command -v runuser >/dev/null; then runuser -u tierd -- "$@"
        else setpriv --reuid=tierd --regid=tierd --init-groups -- "$@"; fi
    }
    as_tierd "$VENV/bin/tierd" --version >/dev/null \
        || die "user tierd cannot run $VENV/bin/tierd (is the venv's interpreter in a directory it" \
               "cannot enter, like /root? remove $VENV and give --python /usr/bin/python3)"
    as_tierd test -r "$CONFIG" || die "user tierd cannot read $CONFIG"
    echo "    user tierd runs $VENV/bin/tierd and reads $CONFIG"
    if command -v systemd-analyze >/dev/null; then
        systemd-analyze verify --man=no "$UNIT" || die "systemd-analyze verify $UNIT failed"
        echo "    systemd-analyze verify $UNIT: ok"
    fi
    # the config as `tierd serve` reads it (no TIERD_* from this shell), and room for every
    # tier: the daemon reserves each whole at start (the host arena in arena_dir, the disk
    # tier's slab files in [disk] path) and refuses to start without the room
    rc=0
    as_tierd env -i PATH=/usr/bin:/bin "$VENV/bin/python" - "$CONFIG" <<'PY' || rc=$?
import glob, os, sys
from tierd.config import ConfigError, format_size, load_serve_config
config = sys.argv[1]
try:
    cfg = load_serve_config(config, env={})
    store = cfg.store.resolved()
except ConfigError as e:
    print(f"install.sh: {config}: {e}", file=sys.stderr)
    sys.exit(2)


def filesystem(path):
    """The directory the tier's files go in, or the nearest one above it that exists."""
    at = os.path.abspath(path)
    while not os.path.isdir(at) and os.path.dirname(at) != at:
        at = os.path.dirname(at)
    return at


def held(pattern):
    """Bytes the tier's own files already take there: a restart reuses them."""
    n = 0
    for p in glob.glob(pattern):
        try:
            n += os.stat(p).st_blocks * 512
        except OSError:
            pass
    return n


tiers = [("host", "[host] bytes", cfg.store.host_bytes, "of RAM", store.host_bytes, cfg.arena_dir, "tierd-*",
          f"or grow {cfg.arena_dir}'s filesystem (see the comment on arena_dir there)")]
if store.disk_path:
    tiers.append(("disk", "[disk] bytes", cfg.store.disk_bytes, "of its filesystem", store.disk_bytes,
                  store.disk_path, "slab-*.tds", "or free space there, or set [disk] path to a larger filesystem"))
short = []
for tier, setting, raw, share, need, path, pattern, other in tiers:
    st = os.statvfs(filesystem(path))
    room = st.f_bavail * st.f_frsize + held(os.path.join(path, pattern))
    size = format_size(st.f_blocks * st.f_frsize)
    given = f"{setting} = \"{raw}\"" + (f", {share}" if "%" in str(raw) else "")
    print(f"    {tier} tier {format_size(need)} ({given}) in {path}: {size} filesystem, "
          f"{format_size(room)} free for it")
    if need > room:
        short.append(f"install.sh: tierd serve would refuse to start: the {tier} tier needs {format_size(need)} "
                     f"({given}) in {path}, which has {format_size(room)} free for it ({size} filesystem); lower "
                     f"{setting} in {config} to at most {format_size(room)} {other}, then run install.sh again")
for line in short:
    print(line, file=sys.stderr)
sys.exit(3 if short else 0)
PY
    [ "$rc" -ne 2 ] || die "tierd serve would refuse $CONFIG (above)"
    [ "$rc" -ne 3 ] || die "a tier does not fit where $CONFIG puts it (above)"
    [ "$rc" -eq 0 ] || echo "    warning: could not check $CONFIG with $VENV/bin/python (exit $rc)"
fi

step "9. left to do"
if [ -d /run/systemd/system ] && [ -z "$ROOT" ] && systemctl is-active --quiet tierd 2>/dev/null; then
    echo "    systemctl daemon-reload && systemctl restart tierd   # runs the new version; keeps the host tier"
else
    echo "    systemctl daemon-reload && systemctl enable --now tierd"
fi
echo "    usermod -aG tierd ENGINE_USER   # engines connect through group tierd (then restart them)"

#!/usr/bin/env bash
# Gives this checkout a virtual environment from a cache kept outside it, building it there
# when the cache lacks it.
#
#   tools/cached_env.sh NAME LINK EDITABLE [FILE...]
#
# NAME: the environment (`make _build-NAME ENV_DIR=DIR` builds it into DIR). LINK: the path in
# this checkout (.venv-vllm, ...), made a symbolic link to the cached environment. EDITABLE:
# "yes" installs this checkout's tierd into it (`pip install --no-deps -e .`, a few seconds;
# skipped while the environment already points at this checkout). FILEs: files of the tree the
# build installs (their contents are part of the key).
#
# The key is what the build installs, exactly: the Python that makes it, the commands of its
# recipe with every pin and package list expanded (`make -n`), tierd's own dependencies from
# pyproject.toml and the FILEs. Anything else (another commit, the tests) reuses the
# environment. The cache ($TIERD_ENV_CACHE, default ~/.cache/tierd/envs) keeps the two
# environments of each NAME used last and removes older ones; `make clean-envs` empties it.
# Builds and re-points take a lock per NAME, so checkouts on one machine can share the cache.
set -euo pipefail
name=$1 link=$2 editable=$3
shift 3
cache=${TIERD_ENV_CACHE:-$HOME/.cache/tierd/envs}
python=${PYTHON:-python3}
mkdir -p "$cache"

key=$({
    "$python" -c 'import sys; print(sys.version, sys.executable)'
    make -s -n --no-print-directory "_build-$name" ENV_DIR=ENV_DIR
    sed -n '/^dependencies = \[/,/^\]/p' pyproject.toml
    [ "$#" -eq 0 ] || cat "$@"
} | sha256sum | cut -c1-16)
dir="$cache/$name-$key"

exec 9>"$cache/$name.lock"
flock 9
if [ ! -e "$dir/.installed" ]; then
    rm -rf "$dir"
    echo "building the $name environment into $dir (cached for later checkouts)"
    if ! make -s --no-print-directory "_build-$name" ENV_DIR="$dir"; then
        rm -rf "$dir"
        echo "cached_env: building the $name environment failed" >&2
        exit 1
    fi
    [ "$editable" != yes ] || echo "$PWD" > "$dir/.tierd-checkout"   # (the recipe's `pip install -e .`)
    touch "$dir/.installed"
fi
touch "$dir"   # used now: the last to be removed
# the NAME's environments beyond the two used last go (an SGLang one is ~7 GB)
ls -1dt "$cache/$name"-????????????????/ 2>/dev/null | tail -n +3 | while read -r old; do
    [ "${old%/}" = "$dir" ] || { echo "removing the unused $name environment ${old%/}"; rm -rf "${old%/}"; }
done

if [ -L "$link" ] || [ -e "$link" ]; then
    [ "$(readlink "$link" 2>/dev/null)" = "$dir" ] || rm -rf "$link"
fi
[ -L "$link" ] || ln -s "$dir" "$link"
if [ "$editable" = yes ] && [ "$(cat "$dir/.tierd-checkout" 2>/dev/null)" != "$PWD" ]; then
    "$link/bin/python" -m pip install --quiet --no-deps -e .
    echo "$PWD" > "$dir/.tierd-checkout"
fi

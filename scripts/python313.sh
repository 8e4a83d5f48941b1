#!/usr/bin/env bash
# The project under a second Python, 3.13 (CI's py313 steps; docs/ci.md says why and what runs). This machine's
# Debian has no python3.13, so the script builds a minimal Debian trixie root with Debian's python3.13 in
# .py313/root (gitignored) and enters it with chroot: no compiler, no Python built from source.
#
#   bash scripts/python313.sh [setup] [tests] [models] [-- pytest args]     (no part: all three; needs root)
#
#   setup   the root (mmdebstrap, installed with apt-get if missing; reused once complete), its venv /venv with
#           torch and transformers at .ci/run's pins (reused while the pins match), then the project from the
#           repo (bind-mounted at /src): `pip install -e '.[test]'`
#   tests   the release-independent unit tests: pytest -n 2 --dist loadscope -m "not release_dependent"
#   models  tests/mixers/test_fingerprint.py (the mixer registry's keys equal Python 3.11's on every modeling
#           file), then `hfpatch models --check --no-heads`: the model sweep against MODELS.md (the heads table, which
#           needs peft and the CI pin's venv, is checked by the README suite)
#
# Inside the root, pip sees what it sees on this machine: the host's pip configuration files, its PIP_* and CA
# variables, the files they name (CA bundle, constraints) copied in, and the local index / wheel folders they name
# bind-mounted read-only. All mounts (/proc, /sys, /dev, /dev/shm, /src, those folders) live in a private mount
# namespace and are unmounted on exit, whatever the exit. Each part prints `py313 <part> <seconds>s`.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
if [ -z "${_PY313_PRIVATE_MOUNTS:-}" ]; then   # mounts made below vanish with this namespace, even on SIGKILL
    _PY313_PRIVATE_MOUNTS=1 exec unshare --mount --propagation private bash "$repo/scripts/$(basename "$0")" "$@"
fi
base=$repo/.py313
root=$base/root
suite=trixie
packages=python3.13,python3.13-venv,ca-certificates,libstdc++6

die() { echo "scripts/python313.sh: $*" >&2; exit 1; }
timed() { local part=$1 start=$SECONDS; shift; "$@"; echo "py313 $part $((SECONDS - start))s"; }

# The pins are .ci/run's (the CI venv's torch and transformers).
. "$repo/scripts/ci_pins.sh"

# --- the root ------------------------------------------------------------------------------------------------------

# The Debian mirror apt uses on this machine (deb822 or one-line sources), else Debian's own.
debian_mirror() {
    local url
    url=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
          grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ')
    echo "${url:-http://deb.debian.org/debian}"
}

build_root() {
    [ -f "$root/.complete" ] && return 0
    command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq mmdebstrap >/dev/null; } ||
        die "mmdebstrap is missing and apt-get could not install it"
    rm -rf "$root.partial" "$root" && mkdir -p "$base"
    mmdebstrap --variant=essential --include="$packages" "$suite" "$root.partial" "$(debian_mirror)" ||
        die "mmdebstrap failed to build the $suite root in $root.partial"
    mv "$root.partial" "$root"
    touch "$root/.complete"
}

# --- entering it ---------------------------------------------------------------------------------------------------

mounts=()
unmount_all() {
    local i
    for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
        umount "${mounts[i]}" 2>/dev/null || umount -l "${mounts[i]}" 2>/dev/null || true
    done
}
trap unmount_all EXIT

mount_in() {  # mount_in TARGET-IN-ROOT MOUNT-ARGS...
    mkdir -p "$root$1"
    mount "${@:2}" "$root$1"
    mounts+=("$root$1")
}

# Host variables that carry into the root: pip's, the CA bundle's, proxies, CI.
passthrough=()
carry_variables() {
    local name
    for name in $(compgen -e); do
        [[ $name =~ ^(PIP_[A-Z_]+|SSL_CERT_FILE|SSL_CERT_DIR|REQUESTS_CA_BUNDLE|CURL_CA_BUNDLE|https?_proxy|HTTPS?_PROXY|no_proxy|NO_PROXY|CI)$ ]] &&
            passthrough+=("$name=${!name}")
    done
    [ -n "${PIP_CONFIG_FILE:-}" ] || [ -n "${PIP_NO_CACHE_DIR:-}" ] || passthrough+=(PIP_NO_CACHE_DIR=1)
    return 0
}

# The host's pip configuration, at the paths pip reads inside the root (HOME is /root there), then every local
# path it or the carried variables name: files copied in, folders (wheels, file:// indexes) bind-mounted read-only.
carry_pip_setup() {
    local f dest path configs=()
    for f in /etc/pip.conf /etc/xdg/pip/pip.conf "$HOME/.config/pip/pip.conf" "$HOME/.pip/pip.conf" \
             "$HOME/.config/pip/pip.ini" ${PIP_CONFIG_FILE:-}; do
        [ -f "$f" ] || continue
        dest=${f/#$HOME//root}
        [ "$f" = "${PIP_CONFIG_FILE:-}" ] && dest=$f
        install -D -m 0644 "$f" "$root$dest"
        configs+=("$f")
    done
    for path in $( { cat "${configs[@]}" /dev/null; printf '%s\n' "${passthrough[@]}"; } |
                   grep -oE '(file://)?/[^[:space:]"'"'"',;]+' | sed 's#^file://##' | sort -u); do
        if [ -f "$path" ]; then
            install -D -m 0644 "$path" "$root$path"
        elif [ -d "$path" ]; then
            [ "$(basename "$path")" = simple ] && path=$(dirname "$path")   # an index's files lie beside simple/
            # a folder of the root's own (/etc/ssl/certs), or one mounted already; an empty one is a mount point
            [ -n "$(ls -A "$root$path" 2>/dev/null)" ] && continue
            mount_in "$path" --bind "$path"
            mount -o remount,bind,ro "$root$path"
        fi
    done
}

enter_root() {
    mount_in /proc -t proc proc
    mount_in /sys --bind /sys
    mount_in /dev --bind /dev
    mount_in /dev/shm -t tmpfs -o mode=1777 shm
    mount_in /src --bind "$repo"
    cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
    cp /etc/hosts "$root/etc/hosts"        # localhost for the gloo worlds
    carry_variables
    carry_pip_setup
}

in_root() {  # in_root COMMAND...: run in the root, in /src, with the venv first on PATH and only the carried variables
    chroot "$root" /usr/bin/env -i --chdir=/src HOME=/root LANG=C.UTF-8 PATH=/venv/bin:/usr/bin:/bin \
        "${passthrough[@]}" "$@"
}

# --- the parts -----------------------------------------------------------------------------------------------------

install_torch() {
    local torch=$1
    [ "$(cat "$root/venv/.pins" 2>/dev/null)" = "$torch" ] && return 0
    rm -rf "$root/venv"
    in_root python3.13 -m venv /venv
    # the CUDA build: PyPI has no CPU build for cp313; it runs on CPU. No bytecode at install (most of its files are
    # never imported): Python writes it at first import (env -i: no PYTHONDONTWRITEBYTECODE in the root).
    in_root python -m pip install -q --no-compile "$torch"
    echo "$torch" >"$root/venv/.pins"
}

setup() {
    local torch transformers
    torch=$(ci_pin torch) transformers=$(ci_pin transformers)
    timed root build_root
    enter_root
    timed venv-torch install_torch "$torch"
    timed project in_root python -m pip install -q --no-compile -e '.[test]' "$transformers"
    # The files the root's venv holds in the same bytes as the CI venv or a torch venv (its NVIDIA libraries are the
    # CI venv's: those wheels are Python-independent): hard-linked to that copy, to spare the disk (docs/ci.md).
    python3 scripts/link_duplicates.py "$root/venv" .venv .venv-torch-*
    in_root python -c 'import sys, torch, transformers, hfpatch; print("py313 python", sys.version.split()[0],
        "torch", torch.__version__, "transformers", transformers.__version__)'
}

parts=() pytest_args=()
while [ $# -gt 0 ]; do
    case $1 in
        setup|tests|models) parts+=("$1") ;;
        --) shift; pytest_args=("$@"); break ;;
        *) die "unknown part '$1' (setup, tests, models; pytest arguments after --)" ;;
    esac
    shift
done
[ ${#parts[@]} -gt 0 ] || parts=(setup tests models)
[ "$(id -u)" = 0 ] || die "needs root (mmdebstrap, mount, chroot)"

for part in "${parts[@]}"; do
    if [ "$part" = setup ]; then
        setup
        continue
    fi
    [ -f "$root/.complete" ] && [ -f "$root/venv/.pins" ] || die "no complete root in $root: run setup first"
    [ ${#mounts[@]} -gt 0 ] || enter_root
    case $part in
        tests) timed tests in_root python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope \
                   -m "not release_dependent" "${pytest_args[@]}" ;;
        models) timed fingerprints in_root python -m pytest -q -p no:cacheprovider tests/mixers/test_fingerprint.py
                timed models in_root hfpatch models --check --no-heads ;;
    esac
done

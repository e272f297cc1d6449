#!/usr/bin/env bash
# One command that prepares a fresh Debian 12 machine (as root) for btrfs-ublk-image:
# apt packages, a Python venv with the package and its dev tools, the ublkd build,
# and both commands on PATH (/usr/local/bin). Idempotent; safe to run again.
#
#   scripts/setup.sh            # everything
#   SKIP_APT=1 scripts/setup.sh # skip apt (packages already present)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
log() { printf '[setup] %s\n' "$*" >&2; }

APT_PACKAGES=(
  btrfs-progs       # mkfs.btrfs/btrfs check: oracles in tests, baseline in bench
  e2fsprogs attr acl kmod util-linux  # chattr/lsattr, getfattr/setfattr, getfacl, modprobe, losetup
  fuse3 libfuse3-dev pkg-config       # ublkd's fuse frontend
  libclang-dev clang                  # bindgen for the libublk crate
  umoci skopeo      # OCI images: oracle and baseline in tests and bench
  mmdebstrap        # the Debian golden image's rootfs, reproducible (specs/golden/debian)
  zstd xz-utils bzip2 gzip cpio       # tarball flavours, initramfs
  tar libarchive-tools git            # GNU tar and bsdtar: the tar reader's oracles and test writers
  fio squashfs-tools squashfuse erofs-utils  # benchmarks against the peers
  bubblewrap        # bwrap: runs a container on a mounted bundle (tests/test_many_mounts.py, README)
  qemu-system-x86 busybox-static      # VM harness (ublk under QEMU TCG)
  python3 python3-venv python3-pip
  curl ca-certificates
  nginx-light docker-registry         # remote packs: HTTP range server and OCI registry (tests, bench)
  apache2-utils     # htpasswd -B: bcrypt password files of the registry auth tests (test_push, test_remote)
  containerd runc   # containerd 1.6 + runc: containers through btrfs-ublk-snapshotter (tests, bench)
  gnupg             # gpg: ublkd verifies image signatures with it; tests sign with skopeo + gpg (docs/signatures.md)
  strace            # tests/test_hostile_images.py: no crafted image reaches mount(2)
  podman            # podman 4.3: pulls through btrfs-ublk-snapshotter podman-store, --rootfs MNT:O (tests/test_podman.py)
)

if [ -z "${SKIP_APT:-}" ]; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt: installing ${missing[*]}"
    # a private archive dir: this image's apt hook deletes /var/cache/apt/archives/*.deb after dpkg runs
    mkdir -p /var/cache/btrfs-ublk-image/apt/partial
    apt-get update -qq
    # servers (nginx, docker-registry) must not start system-wide on install: the tests
    # and benchmarks run their own instances on loopback ports
    policy_rc=/usr/sbin/policy-rc.d
    [ -e "$policy_rc" ] || { printf '#!/bin/sh\nexit 101\n' >"$policy_rc"; chmod +x "$policy_rc"; trap 'rm -f "$policy_rc"' EXIT; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      -o Dir::Cache::archives=/var/cache/btrfs-ublk-image/apt "${missing[@]}"
  fi
fi

# The pinned Debian package set of the golden image (specs/golden/debian/prepare.sh), kept
# where a later checkout finds it when ../shared/debian-minbase is not beside it.
if [ -f "$ROOT/../shared/debian-minbase/SHA256SUMS" ]; then
  log "debian-minbase: copying the pinned package set to /var/cache/btrfs-ublk-image"
  mkdir -p /var/cache/btrfs-ublk-image
  src="$ROOT/../shared/debian-minbase"
  rm -rf /var/cache/btrfs-ublk-image/debian-minbase.tmp
  cp -a "$src" /var/cache/btrfs-ublk-image/debian-minbase.tmp
  rm -rf /var/cache/btrfs-ublk-image/debian-minbase
  mv /var/cache/btrfs-ublk-image/debian-minbase.tmp /var/cache/btrfs-ublk-image/debian-minbase
fi

# Python: a venv inside the checkout, so the system Python stays untouched (PEP 668).
# Its interpreter is the one apt installed above (Debian's, built with PGO and LTO), not
# whatever `python3` comes first on PATH: a pyenv build without them ran a Debian-image
# build ~13% slower (bench/results/issue23-log.md, session 17). PYTHON=... overrides.
PY=${PYTHON:-/usr/bin/python3}
if [ ! -x .venv/bin/python ]; then
  log "python: creating .venv"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[dev]'
# the package's bytecode: an editable install writes none, and neither does Python when
# PYTHONDONTWRITEBYTECODE is set, so every command would compile ~30 modules (~0.1 s)
.venv/bin/python -m compileall -q btrfs_ublk_image
ln -sf "$ROOT/.venv/bin/btrfs-ublk-image" /usr/local/bin/btrfs-ublk-image

# ublkd (Rust). cargo comes from rustup where present, else Debian's package. Debian 12's
# `cargo`/`rustc` (1.63) are too old for ublkd's dependencies (Cargo.lock version 4 needs
# cargo >= 1.78): its `cargo-web`/`rustc-web` (1.85 in bookworm, newer from
# bookworm-security) are the ones to use.
RUST_MIN=1.85
cargo_new_enough() {
  command -v cargo >/dev/null || return 1
  local have
  have=$(cargo --version | cut -d' ' -f2)
  [ "$(printf '%s\n%s\n' "$RUST_MIN" "$have" | sort -V | head -1)" = "$RUST_MIN" ]
}
if [ -f ublkd/Cargo.toml ]; then
  if ! cargo_new_enough && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
  if ! cargo_new_enough; then
    log "cargo: none >= $RUST_MIN found, installing Debian's cargo-web and rustc-web"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      -o Dir::Cache::archives=/var/cache/btrfs-ublk-image/apt cargo-web rustc-web
    cargo_new_enough || { log "cargo: $(cargo --version) is older than $RUST_MIN"; exit 1; }
  fi
  log "ublkd: cargo build --release"
  (cd ublkd && cargo build --release --locked -q)
  install -m 0755 ublkd/target/release/ublkd /usr/local/bin/ublkd
  # the build's native data path and the tree's Inode class (native/, a PyO3 extension):
  # built by maturin (a dev dependency in pyproject.toml) and installed into .venv; the
  # package needs it (docs/design.md, "The tree" and "Native data path")
  log "native: maturin develop --release (btrfs_ublk_native into .venv)"
  (cd native && cargo fetch --locked -q)
  VIRTUAL_ENV="$ROOT/.venv" .venv/bin/maturin develop --release --locked -q -m native/Cargo.toml
fi

# btrfs-ublk-snapshotter (Go): the containerd snapshotter (docs/containerd.md). Its
# containerd module names the Go version it needs (snapshotter/go.mod); a Go >= 1.21
# (scripts/find-go.sh) fetches that toolchain itself through the machine's Go module proxy
# (GOTOOLCHAIN=auto).
GO_BPO=1.23  # the golang-X-go of bookworm-backports installed where no Go is new enough
GO=$(scripts/find-go.sh || true)
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
if [ -z "$GO" ] && [ "$codename" != bookworm ]; then
  log "go: none >= 1.21 found (scripts/find-go.sh), trying Debian's golang-go"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -o Dir::Cache::archives=/var/cache/btrfs-ublk-image/apt golang-go || true
  GO=$(scripts/find-go.sh || true)
fi
if [ -z "$GO" ]; then
  # Debian 12's golang-go is 1.19: golang-$GO_BPO-go from bookworm-backports, on the mirror
  # apt already uses, through a source list of this step only (the system's stays as it is)
  mirror=$(scripts/host-mirror.sh)
  [ -n "$codename" ] && [ -n "$mirror" ] \
    || { log "go: need Go >= 1.21; no Debian codename or apt mirror to find backports"; exit 1; }
  log "go: installing golang-$GO_BPO-go from $codename-backports"
  bpo=/var/cache/btrfs-ublk-image/backports.list
  mkdir -p /var/cache/btrfs-ublk-image
  { cat /etc/apt/sources.list 2>/dev/null || true
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $codename-backports main"
  } >"$bpo"
  apt_bpo=(-o Dir::Etc::SourceList="$bpo")
  apt-get "${apt_bpo[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive apt-get "${apt_bpo[@]}" install -y -q --no-install-recommends \
    -o Dir::Cache::archives=/var/cache/btrfs-ublk-image/apt -t "$codename-backports" "golang-$GO_BPO-go"
  GO=$(scripts/find-go.sh) || { log "go: need Go >= 1.21 (golang-$GO_BPO-go did not provide it)"; exit 1; }
fi
# Debian's Go defaults to GOTOOLCHAIN=local: the go.mod's newer toolchain is fetched only when
# asked (a Go as new as go.mod is used as it is)
export GOTOOLCHAIN=auto
log "snapshotter: go build ($("$GO" version))"
(cd snapshotter && GOFLAGS=-buildvcs=false "$GO" build -trimpath -o btrfs-ublk-snapshotter .)
install -m 0755 snapshotter/btrfs-ublk-snapshotter /usr/local/bin/btrfs-ublk-snapshotter

# containerd 2.x beside Debian's 1.6, for the tests and the bench (not installed on PATH):
# built from the Go module proxy into a cache, keyed by version.
CONTAINERD2_VERSION=v2.4.2
CONTAINERD2_DIR=/var/cache/btrfs-ublk-image/containerd2
if [ -z "${SKIP_CONTAINERD2:-}" ] && [ "$(cat "$CONTAINERD2_DIR/version" 2>/dev/null)" != "$CONTAINERD2_VERSION" ]; then
  log "containerd $CONTAINERD2_VERSION: go install (containerd, ctr, containerd-shim-runc-v2)"
  rm -rf "$CONTAINERD2_DIR"
  mkdir -p "$CONTAINERD2_DIR/bin"
  for cmd in containerd ctr containerd-shim-runc-v2; do
    GOBIN="$CONTAINERD2_DIR/bin" GOFLAGS=-buildvcs=false "$GO" install -trimpath \
      "github.com/containerd/containerd/v2/cmd/$cmd@$CONTAINERD2_VERSION"
  done
  echo "$CONTAINERD2_VERSION" >"$CONTAINERD2_DIR/version"
fi

# --- VM test assets (tests/vm, owner: VM harness) ---------------------------------------
# Kernel with ublk_drv + busybox initramfs for the QEMU VM suite, cached in
# /var/cache/btrfs-ublk-image/vm. SKIP_VM=1 skips it.
log "vm: preparing VM test assets"
bash tests/vm/setup.sh
# --- end VM test assets -------------------------------------------------------------------
log "done: $(command -v btrfs-ublk-image) $(command -v ublkd || echo "(no ublkd)") $(command -v btrfs-ublk-snapshotter)"

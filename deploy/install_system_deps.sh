#!/usr/bin/env bash
# Debian packages the project needs beside the Python ones:
#   libb64-0d              - perf_analyzer (shipped in tritonclient's wheel) links libb64.so.0d
#   dataset-fashion-mnist  - Fashion-MNIST idx files for resnet-ee (/usr/share/datasets/fashion-mnist)
# and, to build the C++ gRPC front of `e3 serve` (deploy/grpc_front/build.sh, run by `make setup` next):
#   g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler
# As root they are installed with apt-get; otherwise they are unpacked into a
# project-local folder ($E3_DEPS_DIR, default .deps/) with `apt-get download` +
# `dpkg-deb -x` (for the build packages, with every dependency not installed yet), and e3 puts that
# folder's lib/ on LD_LIBRARY_PATH itself. A compiler cannot be unpacked that way: without g++ and
# without root, the front is not built and `e3 serve` runs the Python gRPC guard alone (it says so).
# A failed install of the build packages is reported and does not fail the setup, for the same reason.
# Idempotent: a package already present is skipped.
set -euo pipefail
PKGS=(libb64-0d dataset-fashion-mnist)
BUILD_PKGS=(g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler)
DEPS_DIR=${E3_DEPS_DIR:-$(cd "$(dirname "$0")/.." && pwd)/.deps}

have_system() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
have_local() { [ -f "$DEPS_DIR/.$1.done" ]; }
missing_of() { for p in "$@"; do have_system "$p" || have_local "$p" || echo "$p"; done; }

mapfile -t missing < <(missing_of "${PKGS[@]}")
mapfile -t missing_build < <(missing_of "${BUILD_PKGS[@]}")
[ ${#missing[@]} -eq 0 ] && [ ${#missing_build[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  install() {
    apt-get install -y -qq "$@" >/dev/null 2>&1 || { apt-get update -qq >/dev/null && apt-get install -y -qq "$@" >/dev/null; }
  }
  if [ ${#missing[@]} -gt 0 ]; then
    echo "system deps: installing ${missing[*]} with apt-get"
    install "${missing[@]}"
  fi
  if [ ${#missing_build[@]} -gt 0 ]; then
    echo "system deps: installing ${missing_build[*]} with apt-get (to build the C++ gRPC front)"
    install "${missing_build[@]}" || echo "system deps: could not install ${missing_build[*]}; the gRPC front will not be built"
  fi
  exit 0
fi

unpack() {
  mkdir -p "$DEPS_DIR/debs"
  for p in "$@"; do
    (cd "$DEPS_DIR/debs" && apt-get download "$p" >/dev/null) || return 1
    dpkg-deb -x "$DEPS_DIR"/debs/"$p"_*.deb "$DEPS_DIR/root"
    touch "$DEPS_DIR/.$p.done"
  done
}
if [ ${#missing[@]} -gt 0 ]; then
  echo "system deps: not root; unpacking ${missing[*]} into $DEPS_DIR"
  unpack "${missing[@]}"
fi
mapfile -t missing_build < <(missing_of "${BUILD_PKGS[@]}" | grep -v '^g++$' || true)
if [ ${#missing_build[@]} -gt 0 ]; then
  # the build packages with their dependencies that are not installed (virtual packages, <...>, left out)
  mapfile -t closure < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
    --no-replaces --no-enhances "${missing_build[@]}" 2>/dev/null | grep -v '^[ <]' | grep -v ':' | sort -u)
  mapfile -t todo < <(missing_of "${closure[@]}")
  echo "system deps: not root; unpacking ${#todo[@]} packages for the gRPC front (${missing_build[*]} and their dependencies) into $DEPS_DIR"
  unpack "${todo[@]}" || echo "system deps: could not unpack them; the gRPC front will not be built"
fi

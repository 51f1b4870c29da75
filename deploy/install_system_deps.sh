#!/usr/bin/env bash
# Debian packages the project needs beside the Python ones:
#   libb64-0d              - perf_analyzer (shipped in tritonclient's wheel) links libb64.so.0d
#   dataset-fashion-mnist  - Fashion-MNIST idx files for resnet-ee (/usr/share/datasets/fashion-mnist)
# As root they are installed with apt-get; otherwise they are unpacked into a
# project-local folder ($E3_DEPS_DIR, default .deps/) with `apt-get download` +
# `dpkg-deb -x`, and e3 puts that folder's lib/ on LD_LIBRARY_PATH itself.
# Idempotent: a package already present is skipped.
set -euo pipefail
PKGS=(libb64-0d dataset-fashion-mnist)
DEPS_DIR=${E3_DEPS_DIR:-$(cd "$(dirname "$0")/.." && pwd)/.deps}

have_system() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
have_local() { [ -f "$DEPS_DIR/.$1.done" ]; }

missing=()
for p in "${PKGS[@]}"; do
  have_system "$p" || have_local "$p" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "system deps: installing ${missing[*]} with apt-get"
  apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null; }
  exit 0
fi

echo "system deps: not root; unpacking ${missing[*]} into $DEPS_DIR"
mkdir -p "$DEPS_DIR/debs"
for p in "${missing[@]}"; do
  (cd "$DEPS_DIR/debs" && apt-get download "$p")
  dpkg-deb -x "$DEPS_DIR"/debs/"$p"_*.deb "$DEPS_DIR/root"
  touch "$DEPS_DIR/.$p.done"
done

#!/usr/bin/env bash
# Builds e3-grpc-front (the C++ gRPC front of `e3 serve`, front.cc) into OUT (default: deploy/grpc_front/build/).
#
#   bash deploy/grpc_front/build.sh [OUT]        PYTHON=.venv/bin/python by default (tritonclient must be there)
#
# Needs g++ (C++17), pkg-config, libgrpc++-dev, libprotobuf-dev and protoc (deploy/install_system_deps.sh
# installs them). Triton's protos: tritonclient's wheel ships only the Python modules, so the FileDescriptorSet
# is written from tritonclient.grpc.service_pb2.DESCRIPTOR and protoc --descriptor_set_in makes the C++ classes.
# Where something is missing it says so in one line and exits 0: `e3 serve` then runs the Python gRPC guard alone.
# A build newer than every input is kept (a second `make setup` does nothing).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
OUT=${1:-$HERE/build}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
BIN=$OUT/e3-grpc-front
DEPS_ROOT=${E3_DEPS_DIR:-$ROOT/.deps}/root   # headers and libraries install_system_deps.sh unpacked (not root)

# Locally unpacked packages (not root): their headers, libraries, pkg-config files and protoc.
if [ -d "$DEPS_ROOT/usr" ]; then
  export PKG_CONFIG_PATH="$DEPS_ROOT/usr/lib/x86_64-linux-gnu/pkgconfig:$DEPS_ROOT/usr/lib/pkgconfig:${PKG_CONFIG_PATH:-}"
  export PKG_CONFIG_SYSROOT_DIR=""
  export PATH="$DEPS_ROOT/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$DEPS_ROOT/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  LOCAL_FLAGS=(-I"$DEPS_ROOT/usr/include" -L"$DEPS_ROOT/usr/lib/x86_64-linux-gnu")
else
  LOCAL_FLAGS=()
fi

skip() { echo "grpc front: not built ($1); e3 serve will use the Python gRPC guard alone"; exit 0; }
command -v g++ >/dev/null || skip "no g++"
command -v protoc >/dev/null || skip "no protoc (Debian: protobuf-compiler)"
command -v pkg-config >/dev/null || skip "no pkg-config"
pkg-config --exists grpc++ protobuf 2>/dev/null || skip "no libgrpc++-dev / libprotobuf-dev"
[ -x "$PYTHON" ] || skip "no Python at $PYTHON"

newest_input=$(ls -t "$HERE"/*.cc "$HERE"/*.h "$HERE"/build.sh | head -1)
if [ -x "$BIN" ] && [ "$BIN" -nt "$newest_input" ] && "$BIN" --help >/dev/null 2>&1; then
  exit 0
fi

mkdir -p "$OUT/gen" "$OUT/obj"
"$PYTHON" - "$OUT/triton.desc.new" <<'EOF'
import sys
from google.protobuf import descriptor_pb2
from tritonclient.grpc import service_pb2
files = descriptor_pb2.FileDescriptorSet()
def add(fd):   # dependencies first, each once
    for dep in fd.dependencies:
        add(dep)
    if all(f.name != fd.name for f in files.file):
        fd.CopyToProto(files.file.add())
add(service_pb2.DESCRIPTOR)
open(sys.argv[1], "wb").write(files.SerializeToString())
EOF
if ! cmp -s "$OUT/triton.desc.new" "$OUT/triton.desc" || [ ! -f "$OUT/gen/grpc_service.pb.cc" ]; then
  mv "$OUT/triton.desc.new" "$OUT/triton.desc"
  protoc --descriptor_set_in="$OUT/triton.desc" --cpp_out="$OUT/gen" grpc_service.proto model_config.proto
fi
rm -f "$OUT/triton.desc.new"

CXXFLAGS=(-std=c++17 -O2 -g0 -Wall -I"$OUT/gen" -I"$HERE" "${LOCAL_FLAGS[@]}" $(pkg-config --cflags grpc++ protobuf))
echo "grpc front: building $BIN (about a minute on 2 cores)"
pids=()
for src in "$OUT/gen/grpc_service.pb.cc" "$OUT/gen/model_config.pb.cc" "$HERE/check.cc" "$HERE/front.cc" "$HERE/infer.cc"; do
  obj="$OUT/obj/$(basename "$src" .cc).o"
  if [ ! -f "$obj" ] || [ "$src" -nt "$obj" ] || [ "$HERE/check.h" -nt "$obj" ] || [ "$HERE/options.h" -nt "$obj" ] || [ "$HERE/front.h" -nt "$obj" ]; then
    g++ "${CXXFLAGS[@]}" -c "$src" -o "$obj" & pids+=($!)
  fi
done
for p in "${pids[@]}"; do wait "$p" || skip "a compile step failed (see above)"; done
g++ -o "$BIN.tmp" "$OUT"/obj/*.o "${LOCAL_FLAGS[@]}" $(pkg-config --libs grpc++ protobuf absl_synchronization) -lpthread \
  || skip "the link failed (see above)"
mv "$BIN.tmp" "$BIN"
echo "grpc front: built $BIN"

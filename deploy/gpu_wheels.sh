#!/usr/bin/env bash
# What a bare GPU host needs to run benchmarks/gpu_side_by_side.py, brought from a machine with the package
# registry into .gpu_wheels/ (gitignored; carry it to the host beside the checkout, 64 MiB at most):
#   tritonserver-2.51-trimmed.tar.xz  the nvidia-pytriton wheel's tritonserver, its libraries, the Python backend
#                                     and the stubs for Python 3.11 and 3.12 (27 MB instead of the wheel's 55)
#   tritonclient-2.51.0-py3-none-any.whl, python_rapidjson-*-cp312-*.whl   the pure-Python gRPC client
#   numpy-1.26.4-cp312-*.whl          numpy<2 for the Python-backend stub (with numpy 2 it returns empty outputs)
# Usage: bash deploy/gpu_wheels.sh [DEST] [PYTHON_VERSION]   (make gpu-wheels)
set -euo pipefail
DEST=${1:-.gpu_wheels}; PYV=${2:-3.12}; TAG=cp${PYV/./}
PIP=${PIP:-.venv/bin/python -m pip}
mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
quiet() { "$@" 2>&1 | { grep -v "neither a file nor a directory" || true; }; }
quiet $PIP download --quiet --no-deps -d "$WORK" nvidia-pytriton==0.7.0
quiet $PIP download --quiet --no-deps -d "$DEST" --python-version "$PYV" --only-binary=:all: --platform any \
    --implementation py tritonclient==2.51.0
quiet $PIP download --quiet --no-deps -d "$DEST" --python-version "$PYV" --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 numpy==1.26.4 python-rapidjson==1.20
mkdir -p "$WORK/x" && (cd "$WORK/x" && python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('$WORK/nvidia_pytriton-*.whl')[0]).extractall('.')")
cd "$WORK/x"
for v in pytriton/tritonserver/python_backend_stubs/*; do
  case "$(basename "$v")" in 3.11|3.12) ;; *) rm -rf "$v" ;; esac
done
rm -f nvidia_pytriton.libs/libpython3-*   # the embedded interpreter of PyTriton's own proxy: not used here
echo "compressing the server (about a minute)"
tar -cJf "$DEST/tritonserver-2.51-trimmed.tar.xz" pytriton/tritonserver nvidia_pytriton.libs
ls -la "$DEST"; du -sh "$DEST"

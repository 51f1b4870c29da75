# The project's own image for the Helm chart (deploy/helm/e3): the `e3` command, which runs the
# controller (`e3 control --pools ... --kubernetes`) and every Triton pod's guard container
# (`e3 serve --guard-only`, with the C++ gRPC front e3-grpc-front built below). With modelRepository.source=export the init container that writes Triton's model
# repository (`e3 export ... --target ngc`) needs PyTorch: it runs e3-export.Dockerfile's image, built on this one.
# Triton itself runs in the NGC-based image of deploy/ngc/Dockerfile.
#
#   docker build -f deploy/helm/images/e3.Dockerfile -t e3:0.1.0 .
#
# Set PYTHON_IMAGE to a Python 3.11 image from the registry you use. Never built in this project (no
# Docker on its machines); tests/test_images.py installs the package from exactly the COPY lines below
# (every folder of pyproject.toml's package-dir), so a folder missing here fails the suite.
#
# Checkpoints are not in the image and nothing here trains: `e3 export` of a trained zoo model (bert-ee,
# resnet-ee, ...) reads them from E3_ARTIFACTS/checkpoints, which the chart mounts from a volume
# (modelRepository.export.checkpointsPvc); or build the repository outside the cluster and mount or
# sync it (docs/kubernetes.md). The controller needs no checkpoint: it plans from the latency profile
# and the served plan.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

WORKDIR /opt/e3
COPY pyproject.toml README.md deploy/helm/images/requirements-e3.txt ./
# Only what the controller, the guard and the CLI import (requirements-e3.txt; no PyTorch, no CUDA, no test
# tooling): tests/test_image_imports.py imports them with exactly this set and sums its size.
RUN python3 -m pip install --no-cache-dir -r requirements-e3.txt
COPY e3 e3
COPY models models
COPY profiling profiling
COPY export export
COPY serving serving
COPY controller controller
COPY client client
COPY deploy deploy
COPY generation generation
COPY simulator simulator
COPY benchmarks benchmarks
COPY cli cli
# A regular (not editable) install: the image holds the package, not a link to its build folder.
RUN python3 -m pip install --no-cache-dir --no-deps --no-build-isolation . && e3 --help > /dev/null \
 && python3 -c "import e3.cli.control, e3.cli.serve, e3.controller.k8s_scaler, e3.deploy.grpc_guard, kubernetes"

# The C++ gRPC front (deploy/grpc_front/: the guard container's public gRPC port), built with Debian's gRPC and
# protobuf (the PYTHON_IMAGE must be Debian 12 based, as python:3.11-slim is) and Triton's protos from the
# tritonclient installed above; the compiler and the headers are removed again, their runtime libraries kept.
RUN apt-get update && apt-get install -y --no-install-recommends g++ pkg-config libgrpc++-dev libprotobuf-dev \
      protobuf-compiler \
 && PYTHON=python3 bash deploy/grpc_front/build.sh /tmp/grpc_front \
 && install -m 0755 /tmp/grpc_front/e3-grpc-front /usr/local/bin/e3-grpc-front \
 && apt-mark manual libgrpc++1.51 libprotobuf32 \
 && apt-get purge -y --auto-remove g++ pkg-config libgrpc++-dev libprotobuf-dev protobuf-compiler \
 && rm -rf /var/lib/apt/lists/* /tmp/grpc_front && e3-grpc-front --help > /dev/null

# E3_ARTIFACTS: where `e3` reads checkpoints and writes its files (a volume in the chart; the root
# filesystem stays read-only).
ENV E3_ARTIFACTS=/var/lib/e3 OMP_NUM_THREADS=1
RUN useradd --uid 1000 --create-home e3 && mkdir -p /var/lib/e3 && chown -R e3 /var/lib/e3
USER 1000
ENTRYPOINT []

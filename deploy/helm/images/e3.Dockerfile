# The project's own image for the Helm chart (deploy/helm/e3): the `e3` command, which runs the
# controller (`e3 control --pools ... --kubernetes`) and, with modelRepository.source=export, the init
# container that writes Triton's model repository (`e3 export ... --target ngc`).
# Triton itself runs in the NGC-based image of deploy/ngc/Dockerfile.
#
#   docker build -f deploy/helm/images/e3.Dockerfile -t e3:0.1.0 .
#
# Set PYTHON_IMAGE to a Python 3.11 image from the registry you use. Never built in this project (no
# Docker on its machines). Checkpoints are not in the image: mount them (artifacts/checkpoints) or let
# `e3 export` train zoo models on first use (minutes per model).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}

WORKDIR /opt/e3
COPY requirements.txt requirements.lock requirements-nodeps.txt pyproject.toml README.md ./
RUN python3 -m pip install --no-cache-dir -r requirements.txt -c requirements.lock \
 && python3 -m pip install --no-cache-dir --no-deps -r requirements-nodeps.txt
COPY e3 e3
COPY export export
COPY serving serving
COPY controller controller
COPY client client
COPY deploy deploy
COPY generation generation
RUN python3 -m pip install --no-cache-dir --no-deps --no-build-isolation -e . && e3 --help > /dev/null

RUN useradd --uid 1000 --create-home e3 && mkdir -p /opt/e3/artifacts && chown -R e3 /opt/e3/artifacts
USER 1000
ENTRYPOINT []

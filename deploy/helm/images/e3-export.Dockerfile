# The export image: the e3 image (e3.Dockerfile) plus what `e3 export` needs (PyTorch, ONNX, the export
# stack of requirements.txt), for the chart's export init container (modelRepository.source=export,
# modelRepository.export.image). Not the controller's or the guard's image: those stay without PyTorch.
#
#   docker build -f deploy/helm/images/e3.Dockerfile -t e3:0.1.0 .
#   docker build -f deploy/helm/images/e3-export.Dockerfile --build-arg E3_IMAGE=e3:0.1.0 -t e3-export:0.1.0 .
#
# E3_EXTRAS=gpu adds the optional `gpu` extra (TensorRT, ONNX Runtime on CUDA) for engines built on a GPU pool.
ARG E3_IMAGE=e3:0.1.0
FROM ${E3_IMAGE}
ARG E3_EXTRAS=""
USER 0
WORKDIR /opt/e3
COPY requirements.txt requirements.lock requirements-nodeps.txt ./
RUN python3 -m pip install --no-cache-dir -r requirements.txt -c requirements.lock \
 && python3 -m pip install --no-cache-dir --no-deps -r requirements-nodeps.txt \
 && if [ -n "${E3_EXTRAS}" ]; then python3 -m pip install --no-cache-dir ".[${E3_EXTRAS}]" -c requirements.lock; fi
USER 1000

"""What runs inside Triton: the Python-backend models of the request path and the glue they share.

A request's path reads client -> front door -> router -> splits, and every
module here imports only the vocabulary (``e3.core``, which also holds ``session.py``, the one way an
ONNX file is opened) and the modules above it in this table, never the exporter, the controller, the client
or generation (generation's Triton models live in ``generation/`` and import this room):

triton_io.py       the glue: model parameters, gathering requests, responses, BLS calls with typed errors
policy.py          the router's decisions, pure numpy: exits per ramp, survivors, deadline budget, drop reasons
remote.py          a split on another Triton (pool), reached over gRPC with the same typed errors as BLS
router_metrics.py  the router's Prometheus counters (Triton custom metrics), summed locally, flushed in the background
preprocess.py      ``<m>_preprocess``: text in, token ids and mask out (the text front door's first step)
router.py          ``<m>_router``: runs the plan's splits by BLS, applies the exit rule, answers every input
split.py           ``<m>_split_<a>-<b>`` on the embedded server: one split's ONNX file in ONNX Runtime
ee.py              ``<m>_ee``: the early-exit baseline in one process, the batch shrinking in place
tx_probe.py        the echo and caller models ``e3 profile`` uses to measure one BLS hop (Tx)

The exporter (``export/repository.py``, offline) writes a one-line ``model.py`` per model that imports
``TritonPythonModel`` from one of these modules.
"""

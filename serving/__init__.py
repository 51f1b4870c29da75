"""What runs inside Triton: the Python-backend models of the request path and the glue they share.

A request's path reads client -> front door -> router -> splits, and every
module here imports only the vocabulary (``e3.core``, which also holds ``session.py``, the one way an
ONNX file is opened) and the modules above it in this table, never the exporter, the controller, the client
or generation (generation's Triton models live in ``generation/`` and import this room):

triton_io.py       the glue: model parameters, gathering requests, responses, BLS calls with typed errors
input_policy.py    what a served model accepts: batch sizes, NaN/Inf, value bounds (pure, tested without a server)
output_policy.py   what a served model may answer: non-finite outputs refused (pure)
policy.py          the router's decisions, pure numpy: exits per ramp, survivors, deadline budget, drop reasons
batcher.py         Triton's dynamic batcher modelled (pure): the simulator's and E²bird's emulated baselines
scheduler.py       E3 §4 as a pure state machine: per-split queues, dispatch, drops, the admission bound
remote.py          a split on another Triton (pool), reached over gRPC with the same typed errors as BLS
router_metrics.py  the router's Prometheus counters (Triton custom metrics), summed locally, flushed in the background
tokenizer.py       text to token ids (UTF-8 or refused, truncated to the card's length)
preprocess.py      ``<m>_preprocess``: text in, token ids and mask out (the text front door's first step)
router.py          ``<m>_router``: runs the plan's splits by BLS, applies the exit rule, answers every input
compact.py         a compact run of blocks (the router's compact splits, ``<m>_ee``): rows leave between blocks
fused_split.py     the blocks, exit tests and compaction of a compact run composed into one ONNX graph
split.py           ``<m>_split_<a>-<b>`` on the embedded server: one split's ONNX file in ONNX Runtime
ee.py              ``<m>_ee``: the early-exit baseline in one process, the batch shrinking in place
tx_probe.py        the echo and caller models ``e3 profile`` uses to measure one BLS hop (Tx)
device/            E3's device form: every split inside ``<m>_router``'s process on the device (its own room)
ebird/             E²bird's elastic admission stage, all of it (its own room)

The exporter (``export/repository.py``, offline) writes a one-line ``model.py`` per model that imports
``TritonPythonModel`` from one of these modules.
"""

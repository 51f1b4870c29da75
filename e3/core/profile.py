"""Latency profiles and batch profiles: the planner's two inputs (E3 §3.1-3.2).

:class:`LatencyProfile` is E3's ``P(k, c, B)``: the latency of block ``k`` on
device configuration ``c`` at batch ``B``, measured on the runtime that serves
the splits (``e3 profile``) or modelled from public GPU figures (then
``modelled`` is true and every report says so). Block 1 includes the stem
(embeddings) and block L the final head. A ramp's own latency is stored
apart, so that a plan that disables a ramp (E3 §3.4) does not pay for it.
``tx_ms`` is the cost of moving one cut's tensors between two splits (a BLS
hop here, a network transfer across machines) at batch ``B``.

Optional curves per device, over the same batch sizes (absent in older
files: they read as described, and the file version stays 1):

* ``tx_in_ms`` -- the hop that carries the *model inputs* into the first split
  (smaller than a cut's state); absent: ``tx_ms``.
* ``check_ms`` -- the router's exit check at one ramp and the compaction of the
  rows that go on (a compact split pays it between blocks); absent: 0.
* ``router_ms`` -- the router's own work per batch of a split (stacking rows
  into a batch, the exit rule at the split's end, answering); absent: 0.
* ``stock_ms`` / ``stock_2t_ms`` -- the stock model (every block, no ramp) as
  the one graph ``<m>_stock`` serves, on 1 and on 2 intra-op threads: the
  whole graph is a little faster than the sum of its blocks (one session
  call), and the pair gives the measured gain of a second thread at each batch
  (the simulator's baselines read both); absent: the sum of the blocks, and an
  assumed parallel efficiency.
* ``request_ms`` -- host CPU per request of B inputs that no instance's time
  holds: the client (the load generator, on the same cores here) and
  tritonserver's front door (HTTP, queues, handing the request to the model);
  the simulator takes it from the cores the instances run on; absent: 0.
  ``client_ms`` is the load generator's part of it: one Python process whose
  clients share one GIL, so the simulator runs it one request at a time.
* ``jitter_cv`` -- the coefficient of variation of the stock graph's time
  while one copy per core runs it at once (as that many instances do): the
  simulator draws each batch's time with it (lognormal, mean kept); absent: 0.
* ``corun_ms`` -- the stock graph's time on 1 thread while one copy per core
  runs it at once (the median; the same runs as ``jitter_cv``); over
  ``stock_ms`` it is what instances running side by side cost each other
  (:meth:`LatencyProfile.beside`); absent: nothing.

:class:`BatchProfile` is E3's batch profile: for an input batch of ``B0``,
the expected share of inputs that enter each block (block 1: all of them),
with every ramp enabled. The batch reaching block k is ``B0 * reach[k-1]``.

Both are JSON files (version 1). Latencies between measured batch sizes are
interpolated linearly; beyond the largest measured batch they are
extrapolated linearly from the last two points (a planner may ask for B_k/m').
:func:`interp_linear` is the one place a profile is read between its points.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from e3.core.files import write_json_atomic

__all__ = ["PROFILE_VERSION", "OPTIONAL_CURVES", "ProfileError", "DeviceConfig", "LatencyProfile", "BatchProfile",
           "interp_linear"]

PROFILE_VERSION = 1
# optional per-device curves over batch_sizes (see above)
OPTIONAL_CURVES = ("tx_in_ms", "check_ms", "router_ms", "stock_ms", "stock_2t_ms", "request_ms", "client_ms",
                   "jitter_cv", "corun_ms")
_TIME_CURVES = ("tx_in_ms", "check_ms", "router_ms", "stock_ms", "stock_2t_ms", "corun_ms")   # what compute time scales


class ProfileError(ValueError):
    """A malformed profile file; the message names the field."""


def interp_linear(xs: Sequence[float], ys: Sequence[float], x: float | np.ndarray) -> np.ndarray:
    """The value of the measured curve ``ys`` (at ascending ``xs``) at ``x`` (any shape).

    Linear between measured points; the first value below the first point; past
    the last point, linear extrapolation from the last two (a latency keeps
    growing with the batch); 0 where ``x <= 0`` (no input, no work).
    """
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    x = np.asarray(x, dtype=float)
    out = np.interp(x, xs, ys)
    if len(xs) > 1:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), out)
    return np.where(x <= 0, 0.0, out)


@dataclass(frozen=True)
class DeviceConfig:
    name: str                 # e.g. "cpu" (one core, one instance, one thread), "v100", "t4"
    price: float = 1.0        # cost per device per unit time (relative units)
    modelled: bool = False    # True when latencies are modelled, not measured


class _JsonFile:
    """``save``/``load`` of a profile as a JSON file (written atomically; ``KIND`` names it in errors)."""
    KIND = "profile"

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_dict(), sort_keys=False)

    @classmethod
    def load(cls, path: str | Path):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ProfileError(f"cannot read {cls.KIND} {path}: {err}") from None
        return cls.from_dict(data)


@dataclass
class LatencyProfile(_JsonFile):
    model: str                                  # served model name <m>
    num_blocks: int                             # L
    batch_sizes: list[int]                      # measured batch sizes, ascending
    devices: dict[str, DeviceConfig]            # configuration name -> config
    block_ms: dict[str, list[list[float]]]      # device -> [block k-1][batch index] latency of block k, no ramp (ms)
    ramp_ms: dict[str, list[list[float]]]       # device -> [block k-1][batch index] latency of ramp k (0 if none)
    tx_ms: dict[str, list[float]]               # device -> [batch index] one hop between splits (ms)
    spread_ms: dict[str, list[list[float]]] = field(default_factory=dict)  # optional: IQR of block_ms repeats
    source: str = ""                            # how it was made (runtime, repeats, or "modelled from ...")
    tx_in_ms: dict[str, list[float]] = field(default_factory=dict)   # optional: device -> [batch index] the hop
                                                # carrying the model inputs into split 1 (ms); absent: tx_ms
    check_ms: dict[str, list[float]] = field(default_factory=dict)   # optional: device -> [batch index] one exit
                                                # check + compaction of the rows between blocks (ms); absent: 0
    router_ms: dict[str, list[float]] = field(default_factory=dict)  # optional: device -> [batch index] the
                                                # router's own work per batch of a split (ms); absent: 0
    stock_ms: dict[str, list[float]] = field(default_factory=dict)   # optional: device -> [batch index] the
                                                # stock model as one graph, 1 intra-op thread (ms)
    stock_2t_ms: dict[str, list[float]] = field(default_factory=dict)  # optional: the same on 2 threads (ms)
    request_ms: dict[str, list[float]] = field(default_factory=dict)   # optional: device -> [batch index] host
                                                # CPU per request of B inputs outside every instance (ms)
    client_ms: dict[str, list[float]] = field(default_factory=dict)    # optional: the load generator's part
                                                # of request_ms (ms per request)
    jitter_cv: dict[str, list[float]] = field(default_factory=dict)    # optional: device -> [batch index] CV
                                                # of a batch's time beside one neighbour per core (no unit)
    corun_ms: dict[str, list[float]] = field(default_factory=dict)     # optional: the stock graph on 1 thread
                                                # beside one copy of it per core (ms)
    version: int = PROFILE_VERSION
    KIND = "latency profile"

    @property
    def modelled(self) -> bool:
        return any(d.modelled for d in self.devices.values())

    def ramp_mask(self, with_ramp: bool | Iterable[int] = True) -> np.ndarray:
        """[L] bool: which blocks' ramps are paid. ``True``: every ramp the profile prices; ``False``: none;
        blocks: the ramps after those blocks only (a plan's enabled ramps); an [L] bool array: itself."""
        if isinstance(with_ramp, (bool, np.bool_)):
            return np.full(self.num_blocks, bool(with_ramp))
        if isinstance(with_ramp, np.ndarray) and with_ramp.dtype == bool:
            if with_ramp.shape != (self.num_blocks,):
                raise ValueError(f"a ramp mask needs one entry per block ({self.num_blocks}), got {with_ramp.shape}")
            return with_ramp.copy()
        mask = np.zeros(self.num_blocks, dtype=bool)
        for k in with_ramp:
            if 1 <= int(k) <= self.num_blocks:
                mask[int(k) - 1] = True
        return mask

    def block(self, k: int, device: str, batch: float, with_ramp: bool | Iterable[int] = True) -> float:
        """Latency (ms) of block ``k`` (1-based) on ``device`` at ``batch`` inputs (may be fractional), with its
        ramp where ``with_ramp`` says so (see :meth:`ramp_mask`)."""
        t = interp_linear(self.batch_sizes, self.block_ms[device][k - 1], batch)
        if self.ramp_mask(with_ramp)[k - 1]:
            t = t + interp_linear(self.batch_sizes, self.ramp_ms[device][k - 1], batch)
        return float(t)

    def blocks_at(self, device: str, batch: np.ndarray, with_ramp: bool | Iterable[int] = True) -> np.ndarray:
        """Vectorised :meth:`block`: ``out[k-1, ...]`` is block k's latency (ms) at ``batch[k-1, ...]``.

        ``batch`` is [L, ...]: row k-1 holds the batches block k is asked about.
        """
        batch = np.asarray(batch, dtype=float)
        if batch.shape[0] != self.num_blocks:
            raise ValueError(f"blocks_at needs one row per block ({self.num_blocks}), got shape {batch.shape}")
        out = np.stack([interp_linear(self.batch_sizes, self.block_ms[device][k], batch[k])
                        for k in range(self.num_blocks)])
        for k in np.flatnonzero(self.ramp_mask(with_ramp)):
            out[k] += interp_linear(self.batch_sizes, self.ramp_ms[device][k], batch[k])
        return out

    def tx(self, device: str, batch: float | np.ndarray) -> float | np.ndarray:
        """Latency (ms) of one hop between splits carrying ``batch`` inputs (a float for a float)."""
        return self._curve(self.tx_ms[device], batch)

    def tx_in(self, device: str, batch: float | np.ndarray) -> float | np.ndarray:
        """Latency (ms) of the hop carrying ``batch`` model inputs into the first split (``tx_in_ms``;
        ``tx_ms`` where the profile has no such curve)."""
        return self._curve(self.tx_in_ms.get(device, self.tx_ms[device]), batch)

    def check(self, device: str, batch: float | np.ndarray) -> float | np.ndarray:
        """Latency (ms) of one exit check and compaction of ``batch`` rows between blocks (0 if not profiled)."""
        return self._curve(self.check_ms.get(device), batch)

    def router(self, device: str, batch: float | np.ndarray) -> float | np.ndarray:
        """Latency (ms) of the router's own work on one batch of ``batch`` rows of a split (0 if not profiled)."""
        return self._curve(self.router_ms.get(device), batch)

    def stock(self, device: str, batch: float, threads: int = 1) -> float | None:
        """Latency (ms) of the stock model as one graph on ``threads`` intra-op threads (1 or 2: the curves
        measured) at ``batch``; None if not profiled."""
        ys = {1: self.stock_ms, 2: self.stock_2t_ms}.get(threads, {}).get(device)
        return None if ys is None else float(interp_linear(self.batch_sizes, ys, batch))

    def thread_speedup(self, device: str, batch: float, threads: int) -> float | None:
        """The thread model: how many times faster a graph runs on ``threads`` intra-op threads than on 1 at
        ``batch`` rows, measured on the stock graph (``stock_ms / stock_2t_ms`` at that batch, 2 threads);
        None where not profiled.

        Decision: one curve for every graph the simulator prices (the stock graph, naive EE's and E3's
        blocks, at the rows each block runs), not one per graph. The stock graph is the model's blocks end to
        end, so at a given batch its operators are those of every block (the stem and the head are a few
        percent of it), and ONNX Runtime splits each operator between the threads by its rows and columns:
        the gain at ``batch`` rows is the operators' gain at that batch. What changes between graphs is the
        rows each block runs (naive EE's blocks run fewer rows after every ramp, where a second thread
        gains less), which :func:`e3.core.cost.batch_ms` follows block by block."""
        if threads == 1:
            return 1.0
        one, two = self.stock(device, batch), self.stock(device, batch, 2)
        if threads != 2 or one is None or two is None or two <= 0:
            return None
        return one / two

    def one_graph(self, device: str, batch: float) -> float | None:
        """How much of its blocks' time, each timed as its own session call, a graph of every block takes
        as one call at ``batch`` rows: ``stock_ms`` over the sum of the blocks (no ramps); None where not
        profiled."""
        whole = self.stock(device, batch)
        if whole is None:
            return None
        parts = sum(self.block(k, device, batch, with_ramp=False) for k in range(1, self.num_blocks + 1))
        return whole / parts if parts > 0 else None

    def beside(self, device: str, batch: float) -> float | None:
        """How many times longer a graph takes at ``batch`` rows while one instance per core runs beside it
        than alone: ``corun_ms / stock_ms`` (the cores' shared caches and memory); None where not profiled."""
        alone, together = self.stock(device, batch), self.stock_ms and self.corun_ms.get(device)
        if alone is None or not together or alone <= 0:
            return None
        return float(interp_linear(self.batch_sizes, together, batch)) / alone

    def request(self, device: str, batch: float | np.ndarray) -> float | np.ndarray:
        """Host CPU (ms) of one request of ``batch`` inputs outside every instance (0 if not profiled)."""
        return self._curve(self.request_ms.get(device), batch)

    def client(self, device: str, batch: float | np.ndarray) -> float | np.ndarray:
        """The load generator's CPU (ms) per request of ``batch`` inputs (0 if not profiled)."""
        return self._curve(self.client_ms.get(device), batch)

    def jitter(self, device: str, batch: float) -> float:
        """The CV of a batch's time beside its neighbours at ``batch`` rows (0 if not profiled)."""
        return float(self._curve(self.jitter_cv.get(device), batch))

    def slowed(self, factor: float) -> "LatencyProfile":
        """The same profile with every compute-time curve (blocks, ramps, hops, checks, router, stock graph)
        ``factor`` times longer: the cores the instances run on lose ``1 - 1/factor`` of their time to other
        work (:attr:`request_ms`, which stays as it is)."""
        if not factor >= 1.0:
            raise ValueError(f"a slowdown factor must be >= 1, got {factor}")
        return self._scaled(factor)

    def at_speed(self, factor: float) -> "LatencyProfile":
        """The profile on the same machine running ``factor`` times slower (below 1: faster) than when it was
        measured: every time curve scaled, the host's per-request work (:attr:`request_ms`, :attr:`client_ms`)
        too, since the whole machine drifts. ``factor`` is measured (a reference graph timed at the run against
        the same graph in the profile: ``e3 bench``'s speed reference), not fitted to a result."""
        if not factor > 0:
            raise ValueError(f"a speed factor must be > 0, got {factor}")
        out = self._scaled(factor)
        out.request_ms = {d: [v * factor for v in ys] for d, ys in self.request_ms.items()}
        out.client_ms = {d: [v * factor for v in ys] for d, ys in self.client_ms.items()}
        return out

    def _scaled(self, factor: float) -> "LatencyProfile":
        out = LatencyProfile.from_dict(self.to_dict())
        scale = lambda table: {d: [[v * factor for v in r] for r in rows] for d, rows in table.items()}  # noqa: E731
        out.block_ms, out.ramp_ms = scale(self.block_ms), scale(self.ramp_ms)
        out.tx_ms = {d: [v * factor for v in ys] for d, ys in self.tx_ms.items()}
        for name in _TIME_CURVES:
            setattr(out, name, {d: [v * factor for v in ys] for d, ys in getattr(self, name).items()})
        return out

    def _curve(self, ys: Sequence[float] | None, batch: float | np.ndarray) -> float | np.ndarray:
        """A per-batch curve read at ``batch`` (a float for a float); a missing curve reads 0."""
        x = np.asarray(batch, dtype=float)
        out = np.zeros_like(x) if ys is None else interp_linear(self.batch_sizes, ys, x)
        return float(out) if out.ndim == 0 else out

    def at_batch_sizes(self, batches: Sequence[int]) -> "LatencyProfile":
        """The same profile read at other batch sizes (``interp_linear``); spreads are not extrapolated
        (np.interp keeps the nearest measured one past the ends)."""
        batches = [int(b) for b in batches]
        if batches == list(self.batch_sizes):
            return self
        L, x = self.num_blocks, np.asarray(batches, dtype=float)
        out = LatencyProfile(model=self.model, num_blocks=L, batch_sizes=batches, devices=dict(self.devices),
                             block_ms={}, ramp_ms={}, tx_ms={}, spread_ms={}, source=self.source)
        for name in OPTIONAL_CURVES:
            getattr(out, name).update({dev: np.maximum(0.0, interp_linear(self.batch_sizes, ys, x)).tolist()
                                       for dev, ys in getattr(self, name).items()})
        for dev in self.devices:
            out.block_ms[dev] = [interp_linear(self.batch_sizes, r, x).tolist() for r in self.block_ms[dev]]
            out.ramp_ms[dev] = [np.maximum(0.0, interp_linear(self.batch_sizes, r, x)).tolist()
                                for r in self.ramp_ms[dev]]
            out.tx_ms[dev] = interp_linear(self.batch_sizes, self.tx_ms[dev], x).tolist()
            if dev in self.spread_ms:
                out.spread_ms[dev] = [np.interp(x, self.batch_sizes, r).tolist() for r in self.spread_ms[dev]]
        return out

    def ramp_blocks(self) -> list[int]:
        """Blocks (< L) with a measured ramp on some device: the ramps this profile can speak for."""
        return [k for k in range(1, self.num_blocks)
                if any(max(self.ramp_ms[d][k - 1]) > 0 for d in self.devices)]

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "model": self.model, "num_blocks": self.num_blocks,
                "batch_sizes": list(self.batch_sizes), "source": self.source, "modelled": self.modelled,
                "devices": {n: {"price": d.price, "modelled": d.modelled} for n, d in self.devices.items()},
                "block_ms": self.block_ms, "ramp_ms": self.ramp_ms, "tx_ms": self.tx_ms,
                "spread_ms": self.spread_ms, **{name: getattr(self, name) for name in OPTIONAL_CURVES}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LatencyProfile":
        try:
            if d.get("version", PROFILE_VERSION) != PROFILE_VERSION:
                raise ProfileError(f"latency profile version {d.get('version')!r} is not supported")
            prof = cls(model=d["model"], num_blocks=int(d["num_blocks"]), batch_sizes=[int(b) for b in d["batch_sizes"]],
                       devices={n: DeviceConfig(n, float(v.get("price", 1.0)), bool(v.get("modelled", False)))
                                for n, v in d["devices"].items()},
                       block_ms=d["block_ms"], ramp_ms=d["ramp_ms"], tx_ms=d["tx_ms"],
                       spread_ms=d.get("spread_ms", {}), source=d.get("source", ""),
                       **{name: d.get(name) or {} for name in OPTIONAL_CURVES})
        except KeyError as missing:
            raise ProfileError(f"latency profile is missing the field {missing}") from None
        prof.validate()
        return prof

    def validate(self) -> None:
        B, L = self.batch_sizes, self.num_blocks
        if not B or B != sorted(set(B)) or B[0] < 1:
            raise ProfileError(f"batch_sizes must be ascending, distinct and >= 1, got {B}")
        for dev in self.devices:
            for name, table in (("block_ms", self.block_ms), ("ramp_ms", self.ramp_ms)):
                rows = table.get(dev)
                if rows is None or len(rows) != L or any(len(r) != len(B) for r in rows):
                    raise ProfileError(f"{name}[{dev!r}] must be {L} rows of {len(B)} latencies")
                if any(v < 0 or not np.isfinite(v) for r in rows for v in r):
                    raise ProfileError(f"{name}[{dev!r}] has negative or non-finite latencies")
            if len(self.tx_ms.get(dev, [])) != len(B):
                raise ProfileError(f"tx_ms[{dev!r}] must hold {len(B)} latencies")
        for name in OPTIONAL_CURVES:
            table = getattr(self, name)
            if not isinstance(table, dict):
                raise ProfileError(f"{name} must map device configurations to latencies")
            for dev, ys in table.items():
                if dev not in self.devices:
                    raise ProfileError(f"{name} has device {dev!r}, which the profile does not list")
                if not isinstance(ys, list) or len(ys) != len(B):
                    raise ProfileError(f"{name}[{dev!r}] must hold {len(B)} latencies")
                if any(not isinstance(v, (int, float)) or v < 0 or not np.isfinite(v) for v in ys):
                    raise ProfileError(f"{name}[{dev!r}] has negative or non-finite latencies")


@dataclass
class BatchProfile(_JsonFile):
    model: str               # served model name <m>
    batch_size: int          # B0: the input batch size the shares refer to
    reach: list[float]       # [L] share of inputs entering block k (reach[0] == 1), non-increasing
    source: str = ""         # measured window, workload file, or forecast
    version: int = PROFILE_VERSION
    # Measured from data (``e3 workload/plan --data``): the reach with only some ramps enabled, keyed by
    # ramps_key(enabled ramps) ("1,3"; "" for none), the rule replayed on every ramp's recorded logits. The
    # planner prices a set of ramps with its exact reach where one is here (a dependent rule's exits move
    # in ways the approximation of e3.core.cost.effective_reach cannot follow). Empty: not measured.
    reach_by_ramps: dict[str, list[float]] = field(default_factory=dict)
    exit_rule: dict[str, Any] = field(default_factory=dict)   # the rule the shares were measured under ({}: unsaid)
    KIND = "batch profile"

    def batch_at(self, k: int, b0: float | None = None) -> float:
        """Expected inputs entering block ``k`` for an input batch ``b0`` (default ``batch_size``)."""
        return (self.batch_size if b0 is None else b0) * self.reach[k - 1]

    def to_dict(self) -> dict[str, Any]:
        d = {"version": self.version, "model": self.model, "batch_size": self.batch_size,
             "reach": list(self.reach), "source": self.source}
        if self.reach_by_ramps:
            d["reach_by_ramps"] = {k: list(v) for k, v in self.reach_by_ramps.items()}
        if self.exit_rule:
            d["exit_rule"] = dict(self.exit_rule)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BatchProfile":
        try:
            prof = cls(model=d["model"], batch_size=int(d["batch_size"]), reach=[float(r) for r in d["reach"]],
                       source=d.get("source", ""),
                       reach_by_ramps={str(k): [float(r) for r in v] for k, v in (d.get("reach_by_ramps") or {}).items()},
                       exit_rule=dict(d.get("exit_rule") or {}))
        except KeyError as missing:
            raise ProfileError(f"batch profile is missing the field {missing}") from None
        prof.validate()
        return prof

    def validate(self) -> None:
        r = self.reach
        if not r or abs(r[0] - 1.0) > 1e-9:
            raise ProfileError("reach[0] must be 1 (every input enters block 1)")
        if any(b > a + 1e-9 for a, b in zip(r, r[1:])) or any(not 0 <= x <= 1 for x in r):
            raise ProfileError(f"reach must be non-increasing shares in [0, 1], got {r}")
        for key, v in self.reach_by_ramps.items():
            if len(v) != len(r) or abs(v[0] - 1.0) > 1e-9 or any(b > a + 1e-9 for a, b in zip(v, v[1:])):
                raise ProfileError(f"reach_by_ramps[{key!r}] must be {len(r)} non-increasing shares from 1, got {v}")
        if self.batch_size < 1:
            raise ProfileError(f"batch_size must be >= 1, got {self.batch_size}")

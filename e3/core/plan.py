"""The plan: how an early-exit model is cut, batched and spread over instances (docs/design.md §2).

One versioned JSON document, defined here once. The exporter writes it into
the router's config, the router validates it and keeps the last good one, the
planner (later) produces it and the controller applies it.

Field meanings and units are in the dataclasses below; ``Plan.from_dict``
rejects a malformed document with a :class:`PlanError` that names the field.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from e3.core.exits import BUILTIN_RULES, check_rule_config, make_exit_rule
from e3.core.names import ramps_in_range, split_name

__all__ = ["PLAN_VERSION", "PlanError", "SplitPlan", "Plan", "default_plan", "entry_queue_delay_us", "FORMS",
           "CONSTANT", "COMPACT", "DEVICE"]

PLAN_VERSION = 1

# Split forms (device-aware, chosen per split by the planner from the measured profile):
#   CONSTANT -- E3's form: a Triton model of its own (reached by BLS) runs the whole batch to the split's
#               end; rows that exit at an inner ramp keep computing (the batch never shrinks inside it).
#               What an accelerator wants: its latency barely grows with the batch.
#   COMPACT  -- the router runs the split's blocks itself, one ONNX Runtime call per block, and rows that
#               exit leave the batch between blocks (as ``<m>_ee`` does): no hop, no wasted rows. What a
#               CPU wants: its latency grows linearly with the batch, so every exited row is time saved.
#   DEVICE   -- E3's form on an accelerator (docs/design.md §2b): the split runs inside the router's process on the
#               router instance's execution device (a GPU; the CPU eagerly in tests), at a constant batch;
#               its cut state stays on the device and survivors of any requests are gathered there into the
#               next split's queue (one small host copy per run: the exit decisions). No Triton hop.
#               Decision: a plan is all-device or has no device split (the device router runs the whole
#               model; a device split beside BLS-reached ones is not built), every device split has one
#               instance (the router's one instance per device: the splits share that device, one at a time).
CONSTANT, COMPACT, DEVICE = "constant", "compact", "device"
FORMS = (CONSTANT, COMPACT, DEVICE)


class PlanError(ValueError):
    """A plan document that cannot be used; the message names the field."""


@dataclass(frozen=True)
class SplitPlan:
    model: str                  # Triton model name, <m>_split_<first>-<last>
    first_block: int            # first block in the split (1-based)
    last_block: int             # last block in the split (inclusive)
    batch_size: int             # preferred batch size per Triton instance (inputs)
    instances: int = 1          # Triton instances of this split (the E3 paper's instances)
    device: str = "cpu"         # device configuration name, as in latency profiles
    queue_delay_us: int = 2000  # dynamic batcher's max queue delay (microseconds)
    enabled_ramps: tuple[int, ...] = ()  # ramps computed in this split (blocks < L; the head is implied)
    form: str = CONSTANT        # CONSTANT (own Triton model, constant batch) or COMPACT (in the router, shrinking)
    server: str = ""            # where a constant split runs: "" = the router's own Triton (reached by BLS), else
                                # the gRPC address host:port of the Triton (pool) serving it (reached by tritonclient;
                                # dns:///host:port: every address of host, balanced round-robin)


@dataclass(frozen=True)
class Plan:
    model: str                       # served model name <m> (e.g. "bert_ee")
    num_blocks: int                  # L of the model this plan cuts
    exit_rule: dict[str, Any]        # {"kind": "entropy", "tau_nats": ...} or {"kind": "patience", ...}
    splits: tuple[SplitPlan, ...]    # in block order, covering 1..L without gaps
    slo_ms: float = 1000.0           # latency objective per request (milliseconds)
    slack: float = 0.2               # share of the SLO kept in reserve (E3 §4)
    plan_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    predicted: dict[str, float] = field(default_factory=dict)  # planner's throughput_rps, latency_ms, cost
    version: int = PLAN_VERSION

    @property
    def tau_nats(self) -> float | None:
        """τ of an entropy rule, None for other rules."""
        return self.exit_rule.get("tau_nats")

    @property
    def router_instances(self) -> int:
        """Router instances the plan needs.

        One whenever a split is constant: a single scheduler must see every row to merge survivors of
        all requests into the plan's batches. A plan of compact splits only (this CPU's form: no hop,
        rows leave between blocks) runs one router instance per common share of the splits' instances
        (their gcd), each with its own workers: requests are then admitted and answered in several
        processes at once, as the in-process baseline's instances do (measured: with one instance, its
        per-request work, 1 input per request, left bert-ee's compact plan at 0.84x ``<m>_ee``).
        """
        if any(s.form in (CONSTANT, DEVICE) for s in self.splits):   # device: one instance holds every split
            return 1
        return math.gcd(*(s.instances for s in self.splits))

    @property
    def router_queue_delay_us(self) -> int:
        """Triton's batcher delay in front of the router: 0 with one router instance (its scheduler takes
        every request at once and waits for fuller batches itself); with several (compact splits only,
        answering inline) requests can gather only in Triton's queue, so it waits split 1's delay there
        (measured on ``<m>_ee``, which runs the same way: 2 ms beat 0 by 20% with single-input requests)."""
        return 0 if self.router_instances == 1 else self.splits[0].queue_delay_us

    @property
    def on_device(self) -> bool:
        """Every split is of the device form: the router runs the whole model on its device (docs/design.md §2b)."""
        return self.splits[0].form == DEVICE

    @property
    def triton_splits(self) -> tuple[SplitPlan, ...]:
        """The splits that are Triton models of their own (constant form); compact ones run in the router."""
        return tuple(s for s in self.splits if s.form == CONSTANT)

    @property
    def enabled_ramps(self) -> tuple[int, ...]:
        return tuple(k for s in self.splits for k in s.enabled_ramps)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["splits"] = [dict(asdict(s), enabled_ramps=list(s.enabled_ramps)) for s in self.splits]
        for split in d["splits"]:   # a split on the router's own server: documents stay as before pools
            if not split["server"]:
                del split["server"]
        d["tau_nats"] = self.tau_nats
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanError(f"plan is not valid JSON: {err}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        """Parse and validate a plan document; raises :class:`PlanError`."""
        if not isinstance(data, dict):
            raise PlanError("plan must be a JSON object")
        version = data.get("version", PLAN_VERSION)
        if version != PLAN_VERSION:
            raise PlanError(f"plan version {version!r} is not supported (this build reads {PLAN_VERSION})")
        for key in ("model", "num_blocks", "exit_rule", "splits"):
            if key not in data:
                raise PlanError(f"plan is missing the field {key!r}")
        try:
            # a built-in rule is built to check its fields; a user's rule (module:ClassName) only by its shape
            # here: its module is imported where it runs (the router ships it, e3.export.rules)
            if check_rule_config(data["exit_rule"]) in BUILTIN_RULES:
                make_exit_rule(data["exit_rule"])
        except ValueError as err:
            raise PlanError(f"plan field 'exit_rule': {err}") from None
        if not isinstance(data["splits"], list) or not data["splits"]:
            raise PlanError("plan field 'splits' must be a non-empty list")
        splits = []
        for i, s in enumerate(data["splits"]):
            if not isinstance(s, dict):
                raise PlanError(f"splits[{i}] must be an object")
            try:
                splits.append(SplitPlan(
                    model=str(s["model"]), first_block=_int(s, "first_block", i),
                    last_block=_int(s, "last_block", i), batch_size=_int(s, "batch_size", i),
                    instances=_int(s, "instances", i, 1), device=str(s.get("device", "cpu")),
                    queue_delay_us=_int(s, "queue_delay_us", i, 2000),
                    enabled_ramps=tuple(int(k) for k in s.get("enabled_ramps", ())),
                    form=str(s.get("form", CONSTANT)), server=str(s.get("server") or "")))
            except KeyError as missing:
                raise PlanError(f"splits[{i}] is missing the field {missing}") from None
        known = {f for f in cls.__dataclass_fields__}
        plan = cls(
            model=str(data["model"]), num_blocks=_int(data, "num_blocks"), exit_rule=dict(data["exit_rule"]),
            splits=tuple(splits), slo_ms=_float(data, "slo_ms", 1000.0), slack=_float(data, "slack", 0.2),
            plan_id=str(data.get("plan_id") or uuid.uuid4().hex[:12]),
            predicted={k: float(v) for k, v in (data.get("predicted") or {}).items()},
        )
        unknown = set(data) - known - {"tau_nats"}
        if unknown:
            raise PlanError(f"plan has unknown fields {sorted(unknown)}")
        plan.validate()
        return plan

    def validate(self, ramp_blocks: tuple[int, ...] | None = None) -> None:
        """Check the plan's internal consistency (and, if given, against the model's ramps)."""
        L = self.num_blocks
        if L < 1:
            raise PlanError(f"num_blocks must be >= 1, got {L}")
        if not self.slo_ms > 0:
            raise PlanError(f"slo_ms must be > 0, got {self.slo_ms}")
        if not 0 <= self.slack < 1:
            raise PlanError(f"slack must be in [0, 1), got {self.slack}")
        expected_first = 1
        for i, s in enumerate(self.splits):
            where = f"splits[{i}] ({s.model})"
            if s.first_block != expected_first:
                raise PlanError(f"{where} starts at block {s.first_block}; expected {expected_first} "
                                "(splits must cover blocks 1..L in order, without gaps or overlaps)")
            if s.last_block < s.first_block or s.last_block > L:
                raise PlanError(f"{where} ends at block {s.last_block}, outside {s.first_block}..{L}")
            if s.model != split_name(self.model, s.first_block, s.last_block):
                raise PlanError(f"{where}: name should be "
                                f"{split_name(self.model, s.first_block, s.last_block)!r}")
            if s.form not in FORMS:
                raise PlanError(f"{where}: form {s.form!r} is not one of {', '.join(FORMS)}")
            if (s.form == DEVICE) != (self.splits[0].form == DEVICE):
                raise PlanError(f"{where}: form {s.form!r} beside a {self.splits[0].form!r} split; a plan's splits are "
                                f"either all of the device form (the router runs the model on its device) or none")
            if s.form == DEVICE and s.instances != 1:
                raise PlanError(f"{where}: a device split has one instance (the router's, on its device), "
                                f"got {s.instances}")
            if s.server:
                if s.form != CONSTANT:
                    raise PlanError(f"{where}: a {s.form} split runs inside the router; only a constant split "
                                    f"can be placed on another server (got server {s.server!r})")
                host, _, port = s.server.removeprefix("dns:///").rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
                    raise PlanError(f"{where}: server {s.server!r} is not a gRPC address host:port or "
                                    "dns:///host:port (e.g. e3-triton-gpu:8001); leave it empty for the router's "
                                    "own server")
            if s.batch_size < 1 or s.instances < 1 or s.queue_delay_us < 0:
                raise PlanError(f"{where}: batch_size and instances must be >= 1 and queue_delay_us >= 0")
            for k in s.enabled_ramps:
                if not s.first_block <= k <= s.last_block or k >= L:
                    raise PlanError(f"{where}: enabled ramp {k} is not a ramp inside blocks "
                                    f"{s.first_block}..{min(s.last_block, L - 1)}")
                if ramp_blocks is not None and k not in ramp_blocks:
                    raise PlanError(f"{where}: block {k} has no ramp in this model (ramps: {list(ramp_blocks)})")
            expected_first = s.last_block + 1
        if expected_first != L + 1:
            raise PlanError(f"splits end at block {expected_first - 1}; the last split must end at block {L}")

    @property
    def cuts(self) -> list[int]:
        return [s.last_block for s in self.splits[:-1]]


def entry_queue_delay_us() -> int:
    """The router scheduler's longest wait for a fuller batch at split 1: 2000 us, as at later splits.

    A split's ``queue_delay_us`` is the scheduler's wait (E3 §4: dispatch when
    full, when the SLO forces it, or after this delay); Triton's own batchers
    in front of split models run with no delay, so that they never merge the
    scheduler's batches. At split 1 a wait pays when requests are small:
    measured (bert-ee, 16 clients x 1 input, 2 compact instances) without a
    wait the scheduler ran 3.6 inputs per batch, whose per-input cost on this
    CPU is about 15% above that of batches of 16; with 3 ms, 4.6. (The first
    router, before the scheduler, needed 0 here: Triton's batcher under
    saturation then sent everything queued, up to the maximum batch.)
    """
    return 2000


def default_plan(model: str, num_blocks: int, ranges: list[tuple[int, int]], *, exit_rule: dict[str, Any],
                 ramp_blocks: tuple[int, ...], batch_size: int = 8, instances: int = 1,
                 queue_delay_us: int = 2000, slo_ms: float = 1000.0) -> Plan:
    """A hand-made plan for given block ranges, every ramp enabled (what `e3 export` uses
    until the planner provides one)."""
    splits = tuple(
        SplitPlan(model=split_name(model, a, b), first_block=a, last_block=b, batch_size=batch_size,
                  instances=instances, queue_delay_us=entry_queue_delay_us() if a == 1 else queue_delay_us,
                  enabled_ramps=ramps_in_range(ramp_blocks, a, b, num_blocks=num_blocks))
        for a, b in ranges)
    plan = Plan(model=model, num_blocks=num_blocks, exit_rule=dict(exit_rule), splits=splits, slo_ms=slo_ms)
    plan.validate(ramp_blocks)
    return plan


def _int(d: dict, key: str, i: int | None = None, default: int | None = None) -> int:
    where = f"splits[{i}].{key}" if i is not None else key
    value = d.get(key, default)
    if value is None:
        raise PlanError(f"plan is missing the field {where!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise PlanError(f"plan field {where!r} must be an integer, got {value!r}")
    return int(value)


def _float(d: dict, key: str, default: float) -> float:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanError(f"plan field {key!r} must be a number, got {value!r}")
    return float(value)

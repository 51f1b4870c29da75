"""A compact split as **one ONNX graph**: its blocks, their ramps, the exit rule and the compaction between
blocks, composed at load time from the split's per-block files (``block_<k>[_ramp].onnx``).

Why: on a CPU the per-row cost of a block is nearly flat in batch size, so the best split form is the
compact one (exited rows leave the batch between blocks, as ``<m>_ee`` runs them). Run block by block, each
block is one ONNX Runtime call with Python between calls (the exit rule, slicing the survivors). Measured on
bert-ee (80:20 mix, one thread, in process, 400 inputs): 5.5 ms per input block by block, 5.2 ms fused at 8
inputs per call; 5.2 vs 4.9 ms at 16 (``docs/RESULTS.md``, the scheduler's section). One graph also lets
ONNX Runtime plan memory across the blocks.

The composed graph, for blocks ``first..last`` with enabled ramps ``R`` (the final head, block L, always
answers):

* inputs: the split's inputs (the model's inputs for split 1, else the state), ``n`` rows;
* after block k with a ramp: the ramp's logits are read in float64 exactly as
  :func:`e3.core.exits.entropy_nats` and :func:`~e3.core.exits.softmax` compute them (max-shifted, the
  same order of operations), rows whose entropy is below ``tau_nats`` exit (at the head every row exits);
  their ``label``, ``exit_ramp`` and ``probs`` are scattered into the outputs at their original row;
  the state and the rows' original indices are compressed to the survivors (ONNX ``Compress``), which
  go on to block k+1;
* outputs: ``label`` [n] int64 (-1 for a row still running), ``exit_ramp`` [n] int32 (0 for a row still
  running), ``probs`` [n, C] float32, and when ``last < L`` the survivors' state (``<name>_out``) and
  ``survivors`` [m] int64, their rows among the ``n``.

Decisions:

* **Only independent rules** (entropy, DeeBERT/BranchyNet) are compiled into the graph. A dependent rule
  (PABEE's patience) carries per-row state across ramps; its split runs block by block as before
  (:func:`can_fuse` says which). Nothing else changes for it.
* **Answers stay the reference's**: the logits come from the same exported block graphs, and the exit
  test runs in float64 with the numpy code's operations; as everywhere (docs/design.md §2) a row within 1e-5 nats
  of ``tau`` may flip between runtimes. The router's tests compare every form with the PyTorch reference.
* **A batch in which every row has exited** runs the later blocks on zero rows: ONNX Runtime's kernels
  accept an empty batch (checked by the tests), and a ``Compress`` to zero rows costs nothing, so no
  ``If`` is needed.
* Block graphs are renamed with a ``b<k>_`` prefix (``onnx.compose.add_prefix``) and wired by
  ``Identity`` nodes; the result is kept in memory (serialised for ONNX Runtime), never written.

Pure ``onnx``: testable without Triton; :mod:`e3.serving.router` uses it for its compact splits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, compose, helper, numpy_helper

from e3.core.exits import EntropyRule, ExitRule
from e3.core.names import block_file, ramp_output, state_output

__all__ = ["can_fuse", "fuse_blocks", "compose_split", "ComposedSplit", "FUSED_OUTPUTS", "SURVIVORS"]

FUSED_OUTPUTS = ("label", "exit_ramp", "probs")
SURVIVORS = "survivors"


def can_fuse(rule: ExitRule) -> bool:
    """True when ``rule`` decides at a ramp from that ramp's logits alone, so the graph can hold it."""
    return isinstance(rule, EntropyRule)


@dataclass(frozen=True)
class ComposedSplit:
    """A compact split composed into one graph: what the router runs and how it reads the answers."""
    graph: bytes                     # the serialised ONNX model (for ONNX Runtime)
    outputs: tuple[str, ...]         # FUSED_OUTPUTS, then (below the head) SURVIVORS and the state's outputs
    ramps: tuple[int, ...]           # the ramps it applies, ascending (the head is ramp L)
    state_names: tuple[str, ...]
    inputs: tuple[str, ...] = ()     # the split's inputs the graph reads (its first block's: a state that block
                                     # overwrites without reading, or passes to nobody, is not among them)

    def advance(self, route, out: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Record one run's answers (``out``: output name -> array) in ``route`` (a
        :class:`~e3.serving.policy.BatchRoute`); returns the survivors' state for the next split, None when
        every row is answered."""
        route.settle(out["label"], out["exit_ramp"], out["probs"], self.ramps, out.get(SURVIVORS))
        return None if route.done else {s: out[state_output(s)] for s in self.state_names}


def compose_split(folder: str | os.PathLike, card, first: int, *, last: int, enabled_ramps: tuple[int, ...],
                  tau_nats: float) -> ComposedSplit:
    """Blocks ``first..last`` of the model ``card`` describes, from the block files in ``folder`` (the
    router's version folder: ``block_<k>[_ramp].onnx``), with the ramps in ``enabled_ramps``, composed for an
    entropy rule of ``tau_nats``. Raises ``ValueError`` where the files do not compose."""
    L = card.num_blocks
    enabled = set(enabled_ramps)
    ramps = card.split_ramps(first, last, tuple(enabled_ramps))
    state_names = tuple(t.name for t in card.state)
    graph = fuse_blocks([(k, onnx.load(os.path.join(folder, block_file(k, ramp=k in enabled))))
                         for k in range(first, last + 1)], L, card.num_classes, ramps=ramps, tau_nats=tau_nats,
                        input_names=[t.name for t in (card.inputs if first == 1 else card.state)], state_names=list(state_names))
    outputs = (*FUSED_OUTPUTS, *((SURVIVORS, *map(state_output, state_names)) if last < L else ()))
    return ComposedSplit(graph.SerializeToString(), outputs, tuple(ramps), state_names,
                         tuple(i.name for i in graph.graph.input))


class _Graph:
    """Nodes and initialisers of one graph scope (the composed graph, or an ``If`` branch inside it), with names
    unique across every scope (a branch may read the scopes around it)."""

    def __init__(self, counter: list[int] | None = None):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._counter = counter if counter is not None else [0]

    def branch(self) -> "_Graph":
        return _Graph(self._counter)

    def name(self, hint: str) -> str:
        self._counter[0] += 1
        return f"fx{self._counter[0]}_{hint}"

    def const(self, hint: str, value: np.ndarray) -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: str, **attrs) -> str:
        out = self.name(hint)
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out


def _reduce(g: _Graph, op_type: str, x: str, hint: str, opset: int, keepdims: int) -> str:
    """``op_type`` (ReduceMax or ReduceSum) over axis 1: the axes are an attribute before opset 18 (ReduceSum:
    13), an input since."""
    if opset >= (13 if op_type == "ReduceSum" else 18):
        return g.op(op_type, [x, g.const("axis1", np.array([1], np.int64))], hint, keepdims=keepdims)
    return g.op(op_type, [x], hint, axes=[1], keepdims=keepdims)


def _exit_test(g: _Graph, logits: str, rows: str, tau: str, k: int, final: bool, opset: int) -> tuple[str, str]:
    """Nodes for the rows' probabilities (float32 [m, C], as :func:`e3.core.exits.softmax`) and their exit mask
    (bool [m]: entropy in nats below ``tau``, as :func:`e3.core.exits.entropy_nats`; every row at the head)."""
    z = g.op("Cast", [logits], f"z{k}", to=TensorProto.DOUBLE)
    z = g.op("Sub", [z, _reduce(g, "ReduceMax", z, f"max{k}", opset, 1)], f"shift{k}")
    e = g.op("Exp", [z], f"exp{k}")
    total = _reduce(g, "ReduceSum", e, f"sum{k}", opset, 1)
    probs = g.op("Cast", [g.op("Div", [e, total], f"p64_{k}")], f"probs{k}", to=TensorProto.FLOAT)
    if final:
        true = helper.make_tensor("true", TensorProto.BOOL, [1], [True])
        return probs, g.op("ConstantOfShape", [g.op("Shape", [rows], f"m{k}")], f"all{k}", value=true)
    logp = g.op("Sub", [z, g.op("Log", [total], f"lse{k}")], f"logp{k}")
    plogp = g.op("Mul", [g.op("Exp", [logp], f"p{k}"), logp], f"plogp{k}")
    entropy = g.op("Neg", [_reduce(g, "ReduceSum", plogp, f"h{k}", opset, 0)], f"entropy{k}")
    return probs, g.op("Less", [entropy, tau], f"exits{k}")


@dataclass(frozen=True)
class _Spec:
    """What every scope of one composition shares."""
    blocks: tuple[tuple[int, onnx.ModelProto], ...]
    num_blocks: int
    ramps: frozenset[int]
    state_names: tuple[str, ...]
    opset: int
    tau: str                      # the initialiser holding tau_nats (float64), in the outer scope
    types: tuple[tuple[str, int], ...]   # environment key -> ONNX element type (an If branch declares them)

    @property
    def last(self) -> int:
        return self.blocks[-1][0]


def fuse_blocks(blocks: list[tuple[int, onnx.ModelProto]], num_blocks: int, num_classes: int,
                *, ramps: tuple[int, ...], tau_nats: float, input_names: list[str],
                state_names: list[str]) -> onnx.ModelProto:
    """Compose ``blocks`` (``(k, block k's exported graph)`` for consecutive k, each with its ramp when k is
    in ``ramps`` or is the last block ``num_blocks``) into one graph as the module docstring describes.

    ``input_names``: the split's inputs (the model's inputs when the first block is 1, else the state's
    names); ``state_names``: the state between blocks (``card.state``). The composed graph reads only the
    inputs the first block's graph reads (torch.onnx drops an input a graph never reads: a state the block
    overwrites, or passes to nothing that reads it). Raises ``ValueError`` for blocks that are not consecutive,
    a graph that reads a tensor the card does not name, or one without the outputs the card names."""
    ks = [k for k, _ in blocks]
    if not ks or ks != list(range(ks[0], ks[0] + len(ks))):
        raise ValueError(f"blocks must be consecutive, got {ks}")
    first, last = ks[0], ks[-1]
    g = _Graph()
    opset = max(o.version for _, m in blocks for o in m.opset_import if o.domain in ("", "ai.onnx"))
    sub_inputs = {i.name: i for i in blocks[0][1].graph.input}
    unknown = sorted(set(sub_inputs) - set(input_names))
    if unknown:
        raise ValueError(f"block {first}'s graph reads {unknown}, which the split's inputs {input_names} do not hold")
    input_names = [n for n in input_names if n in sub_inputs]
    if not input_names:
        raise ValueError(f"block {first}'s graph reads none of the split's inputs")
    produced = {o.name: o.type.tensor_type.elem_type for o in blocks[0][1].graph.output}
    types = {"rows": TensorProto.INT64, "label": TensorProto.INT64, "exit_ramp": TensorProto.INT32,
             "probs": TensorProto.FLOAT,
             **{s: produced[state_output(s)] for s in state_names if state_output(s) in produced}}
    spec = _Spec(tuple(blocks), num_blocks, frozenset(ramps), tuple(state_names), opset,
                 g.const("tau", np.array(tau_nats, np.float64)), tuple(types.items()))
    ax0 = g.const("ax0", np.array([0], np.int64))
    n_rows = g.op("Gather", [g.op("Shape", [input_names[0]], "shape"), g.const("zero", np.array(0, np.int64))],
                  "n", axis=0)
    n1 = g.op("Unsqueeze", [n_rows, ax0], "n1")
    env = {
        "rows": g.op("Range", [g.const("start", np.array(0, np.int64)), n_rows, g.const("one", np.array(1, np.int64))],
                     "rows"),
        "label": g.op("Expand", [g.const("minus1", np.array(-1, np.int64)), n1], "label0"),
        "exit_ramp": g.op("Expand", [g.const("zero32", np.array(0, np.int32)), n1], "ramp0"),
        "probs": g.op("Expand", [g.const("zerof", np.zeros((1, num_classes), np.float32)),
                                 g.op("Concat", [n1, g.const("c", np.array([num_classes], np.int64))], "nc", axis=0)],
                      "probs0"),
        **{name: name for name in input_names},
    }
    final = _compose(g, spec, 0, env)
    outputs = [helper.make_tensor_value_info("label", TensorProto.INT64, ["n"]),
               helper.make_tensor_value_info("exit_ramp", TensorProto.INT32, ["n"]),
               helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["n", num_classes])]
    if last < num_blocks:
        outputs.append(helper.make_tensor_value_info(SURVIVORS, TensorProto.INT64, ["m"]))
        last_outs = {o.name: o for o in blocks[-1][1].graph.output}
        for s in state_names:
            info = onnx.ValueInfoProto()
            info.CopyFrom(last_outs[state_output(s)])
            outputs.append(info)
    for info in outputs:
        g.nodes.append(helper.make_node("Identity", [final[_key(info.name, state_names)]], [info.name]))
    graph = helper.make_graph(g.nodes, f"fused_{first}-{last}", [sub_inputs[n] for n in input_names], outputs,
                              g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=blocks[0][1].ir_version)


def _key(output: str, state_names: list[str]) -> str:
    """The environment key of a composed graph's output (``<name>_out`` -> the state's ``name``)."""
    if output == SURVIVORS:
        return "rows"
    for s in state_names:
        if output == state_output(s):
            return s
    return output


def _compose(g: _Graph, spec: _Spec, i: int, env: dict[str, str]) -> dict[str, str]:
    """Blocks ``spec.blocks[i:]`` into scope ``g``, from the environment ``env`` (state name / ``rows`` /
    ``label`` / ``exit_ramp`` / ``probs`` -> tensor). Returns the environment after the split's last block.

    After a ramp with blocks still to run in the split, the rest goes into an ``If`` on "any row left", so
    that no block runs on zero rows (ONNX Runtime's Reshape refuses a 0-row tensor reshaped with -1:
    measured on bert-ee)."""
    for j in range(i, len(spec.blocks)):
        k, model = spec.blocks[j]
        sub = compose.add_prefix(model, f"b{k}_")
        for info in sub.graph.input:
            name = info.name[len(f"b{k}_"):]
            if name not in env:
                raise ValueError(f"block {k}'s graph reads {name!r}, which nothing before it produces")
            g.nodes.append(helper.make_node("Identity", [env[name]], [info.name]))
        g.nodes.extend(sub.graph.node)
        g.inits.extend(sub.graph.initializer)
        outs = {o.name[len(f"b{k}_"):] for o in sub.graph.output}
        env = dict(env)
        if k < spec.num_blocks:
            for s in spec.state_names:
                if state_output(s) not in outs:
                    raise ValueError(f"block {k}'s graph has no output {state_output(s)!r}")
                env[s] = f"b{k}_{state_output(s)}"
        if k not in spec.ramps and k != spec.num_blocks:
            continue
        if ramp_output(k) not in outs:
            raise ValueError(f"block {k}'s graph has no output {ramp_output(k)!r}")
        env = _exit(g, spec, k, f"b{k}_{ramp_output(k)}", env)
        if k < spec.last:
            return _rest_if_any_row(g, spec, j + 1, env)
    return env


def _exit(g: _Graph, spec: _Spec, k: int, logits: str, env: dict[str, str]) -> dict[str, str]:
    """The exit test at ramp k: answers scattered into label / exit_ramp / probs at the exiting rows' original
    index, and (below the head) the rows and state compressed to the survivors."""
    final = k == spec.num_blocks
    p, exits = _exit_test(g, logits, env["rows"], spec.tau, k, final, spec.opset)
    gone = g.op("Compress", [env["rows"], exits], f"gone{k}", axis=0)        # the exiting rows' original index
    where = g.op("Unsqueeze", [gone, g.const("ax1", np.array([1], np.int64))], f"where{k}")
    p_out = g.op("Compress", [p, exits], f"pout{k}", axis=0)
    env = dict(env)
    env["label"] = g.op("ScatterND", [env["label"], where, g.op("ArgMax", [p_out], f"arg{k}", axis=1, keepdims=0)],
                        f"label{k}")
    ramp_k = g.op("Expand", [g.const(f"k{k}", np.array(k, np.int32)), g.op("Shape", [gone], f"ng{k}")], f"kk{k}")
    env["exit_ramp"] = g.op("ScatterND", [env["exit_ramp"], where, ramp_k], f"ramp{k}")
    env["probs"] = g.op("ScatterND", [env["probs"], where, p_out], f"probs{k}_all")
    if not final:   # the survivors go on (to the next block, or out of the split)
        keep = g.op("Not", [exits], f"keep{k}")
        for name in ("rows", *spec.state_names):
            env[name] = g.op("Compress", [env[name], keep], f"{name}{k}", axis=0)
    return env


def _rest_if_any_row(g: _Graph, spec: _Spec, j: int, env: dict[str, str]) -> dict[str, str]:
    """``If`` any row survived: blocks ``spec.blocks[j:]`` (a branch scope), else the environment as it is."""
    keys = ["rows", "label", "exit_ramp", "probs", *(spec.state_names if spec.last < spec.num_blocks else ())]
    then = g.branch()
    done = _compose(then, spec, j, env)
    left = g.op("Greater", [g.op("Size", [env["rows"]], "left"), g.const("zero", np.array(0, np.int64))], "any")
    branches = {}
    for label, scope, values in (("then", then, done), ("else", g.branch(), env)):
        outs = []
        for key in keys:
            name = scope.name(f"{label}_{key}")
            scope.nodes.append(helper.make_node("Identity", [values[key]], [name]))
            outs.append(helper.make_tensor_value_info(name, dict(spec.types)[key], None))
        branches[label] = helper.make_graph(scope.nodes, g.name(label), [], outs, scope.inits)
    results = [g.name(f"if_{key}") for key in keys]
    g.nodes.append(helper.make_node("If", [left], results, then_branch=branches["then"],
                                    else_branch=branches["else"]))
    return {**env, **dict(zip(keys, results))}

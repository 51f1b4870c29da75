"""An exit rule on its way into a model repository: resolved, checked against PyTorch, shipped.

``e3 export`` calls these so that everything serving needs about a rule is checked when exporting, not when
Triton loads the router (issue: an unknown rule exported fine and stopped ``e3 serve`` later):

* :func:`resolve_rule`: the model card's or plan's rule, built (a user's ``module:ClassName`` imported here);
* :func:`ship_rule`: a user's rule module copied into ``<model>/1/e3_rules/`` (Triton's Python processes do
  not see the user's working directory); a rule from an installed package (site-packages) or from e3 itself
  is named, not copied;
* :func:`check_shipped`: the rule built again in a fresh, isolated interpreter (no working directory, no
  ``PYTHONPATH``) from what was shipped, as Triton's stub will build it;
* :func:`check_rule_parity`: the exported block files run by the code ``<m>_ee`` and the router's compact
  splits run (:class:`~e3.serving.compact.CompactRunner`, block by block and, where the rule composes, as
  one graph) against the PyTorch reference at batch 1: labels, exit ramps and probabilities must agree.

Decisions (the issue leaves them open):

* **What is copied**: the rule's module file alone, under its package path, with empty ``__init__.py`` files
  for its parent packages (a package's ``__init__`` often imports the model and torch, which the router
  does not need). A rule module that imports its siblings fails :func:`check_shipped` with the import error
  and the advice to make the module self-contained or install its package.
* **Size**: a module over 1 MB is refused (install it as a package instead).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from e3.core.exits import BUILTIN_RULES, SHIPPED_RULES_DIR, ExitRule, make_exit_rule, rule_config
from e3.models.reference import reference_answers
from e3.serving.compact import CompactRunner
from e3.serving.fused_split import can_fuse

__all__ = ["RuleError", "resolve_rule", "ship_rule", "ship_module", "check_shipped", "check_rule_parity", "RuleParity"]

log = logging.getLogger(__name__)
MAX_MODULE_BYTES = 1 << 20
TIE_BAND = 1e-5          # docs/design.md §2: rows this close to a boundary may flip between runtimes
PROBS_ATOL = 1e-5


class RuleError(ValueError):
    """The exit rule cannot be served as exported; the message says why and what to do."""


def resolve_rule(config) -> ExitRule:
    """The rule ``config`` (dict form or :class:`ExitRule`) names, built; :class:`RuleError` otherwise."""
    try:
        rule = make_exit_rule(config)
        shadowed = [name for name in ("decide", "margin", "init_state", "init_state_for", "relies_on", "params",
                                      "to_dict") if not callable(getattr(rule, name, None))]
        if shadowed:
            raise RuleError(f"exit rule {rule.kind}: the attribute {shadowed[0]!r} hides ExitRule's method of that "
                            "name; give the parameter another name")
        again = make_exit_rule(rule.to_dict())   # what travels in a plan must build the same rule
    except (ValueError, TypeError) as err:
        raise RuleError(str(err)) from None
    if again.to_dict() != rule.to_dict():
        raise RuleError(f"exit rule {rule.kind}: to_dict() gives {rule.to_dict()}, which builds a rule whose "
                        f"to_dict() is {again.to_dict()}; make from_dict and params agree")
    try:
        json.dumps(rule.to_dict())
    except TypeError as err:
        raise RuleError(f"exit rule {rule.kind}: its parameters must be JSON values ({err})") from None
    return rule


def _installed(path: Path) -> bool:
    roots = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    return any(root in path.resolve().parents for root in roots)


def ship_rule(rule: ExitRule, version_dir: Path) -> str | None:
    """Copy the module of a user's ``rule`` into ``version_dir/e3_rules`` (see the module docstring); returns
    the copied file's path relative to ``version_dir``, or None when nothing needs shipping (a built-in, a
    rule of e3's own, or an installed package's)."""
    module_name = type(rule).__module__
    if rule.kind in BUILTIN_RULES or module_name == "e3" or module_name.startswith("e3."):
        return None
    try:
        return ship_module(module_name, version_dir, SHIPPED_RULES_DIR)
    except ValueError as err:
        raise RuleError(f"exit rule {rule.kind}: {err}") from None


def ship_module(module_name: str, version_dir: Path, folder: str) -> str | None:
    """Copy the source file of the imported module ``module_name`` into ``version_dir/folder`` under its
    package path (empty parent ``__init__.py`` files), so that Triton's Python stub, which ignores
    ``PYTHONPATH`` and the user's working directory, imports it from there; returns the copied file's path
    relative to ``version_dir``, or None for a module of an installed package (the server's environment has
    it). ValueError when there is no source file to ship or it is too large. One piece of code for a user's
    exit rule (``e3_rules/``) and a user's model (``e3_models/``)."""
    module = sys.modules.get(module_name)
    source = Path(getattr(module, "__file__", "") or "")
    if not source.is_file() or source.suffix != ".py":
        raise ValueError(f"its module {module_name} has no Python source file to ship ({source}); "
                         "install it as a package in the server's environment instead")
    if _installed(source):
        return None
    if source.stat().st_size > MAX_MODULE_BYTES:
        raise ValueError(f"{source} is over {MAX_MODULE_BYTES >> 20} MB; install it as a "
                         "package in the server's environment instead")
    parts = module_name.split(".")
    if source.name == "__init__.py":
        dest = Path(*parts) / "__init__.py"
    else:
        dest = Path(*parts[:-1], f"{parts[-1]}.py")
    root = version_dir / folder
    for i in range(1, len(dest.parts)):   # parent packages: empty __init__.py files
        init = root.joinpath(*dest.parts[:i], "__init__.py")
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text("")
    (root / dest).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, root / dest)
    return str(Path(folder) / dest)


_CHECK = """
import json, sys
from e3.core.exits import make_exit_rule
rule = make_exit_rule(json.loads(sys.argv[1]), paths=[sys.argv[2]])
print(json.dumps({"torch": "torch" in sys.modules}))
print(json.dumps(rule.to_dict(), sort_keys=True))
"""
# What torch costs a serving process that imports it, measured with the walk-through's model (README, "Serve your
# own model"): the router 248 MB and <m>_ee 281 MB resident with a rule module that imports torch, 51 and 82 MB
# without.
TORCH_COST = "about 200 MB more in each of the router's and <m>_ee's processes (measured: 248 and 281 MB " \
             "against 51 and 82 MB)"


def check_shipped(rule: ExitRule, version_dir: Path, *, timeout_s: float = 60.0) -> None:
    """Build ``rule`` from its dict form in a fresh isolated interpreter (``python -I``: no working directory,
    no ``PYTHONPATH``) with only ``version_dir/e3_rules`` added, as Triton's Python stub will;
    :class:`RuleError` with that interpreter's error otherwise. Logs a warning (the module, the memory cost)
    when building the rule there loads torch: the router and ``<m>_ee`` would carry it (:data:`TORCH_COST`)."""
    config = rule.to_dict()
    version_dir = Path(version_dir).resolve()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", "-c", _CHECK, json.dumps(config),
                           str(version_dir / SHIPPED_RULES_DIR)], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=str(version_dir))
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RuleError(f"exit rule {rule.kind} does not load where the server will run it: {last}. Keep the rule "
                        "in a module that imports only installed packages (numpy, e3, ...), or install its "
                        "package in the server's environment")
    lines = done.stdout.strip().splitlines()
    if json.loads(lines[-1]) != json.loads(json.dumps(config, sort_keys=True)):
        raise RuleError(f"exit rule {rule.kind} loads differently where the server runs it: "
                        f"{lines[-1]} instead of {config}")
    if json.loads(lines[-2])["torch"]:
        log.warning("exit rule %s: its module %s imports torch, which then loads in every serving process that "
                    "runs the rule: %s. Keep the rule in a module that imports only numpy and e3 (the model's "
                    "module may import torch; the rule's need not)", rule.kind, type(rule).__module__, TORCH_COST)


@dataclass(frozen=True)
class RuleParity:
    """What :func:`check_rule_parity` compared."""
    inputs: int            # inputs answered by both
    ties: int              # inputs within the tie band, excluded
    forms: tuple[str, ...]  # the forms checked ("block by block", "composed")


def check_rule_parity(model, rule: ExitRule, folder: Path, *, enabled_ramps: tuple[int, ...],
                      reads: dict[str, list[str]], count: int = 32, seed: int = 11) -> RuleParity:
    """Run ``count`` example inputs through the block files in ``folder`` (every form
    :class:`~e3.serving.compact.CompactRunner` has for ``rule``) and through the PyTorch reference at batch 1;
    :class:`RuleError` naming the first input that differs (label, exit ramp or probabilities)."""
    card = model.card
    arrays = model.example_arrays(count, seed=seed)
    inputs = tuple(arrays[t.name] for t in card.inputs)
    try:
        ref = reference_answers(model, inputs, rule, enabled_ramps=enabled_ramps)
    except Exception as err:  # noqa: BLE001 - the rule's own code may raise anything: say where
        raise RuleError(f"exit rule {rule.kind} fails on the PyTorch reference: {type(err).__name__}: {err}") from None
    ok = ref.min_margin >= TIE_BAND
    forms = []
    for compose in ((False, True) if can_fuse(rule) else (False,)):
        try:
            runner = CompactRunner(folder, card, rule, 1, card.num_blocks, enabled_ramps, compose=compose,
                                   reads=reads)
            route, _ = runner(dict(arrays), rule.init_state_for(dict(arrays), count))
        except Exception as err:  # noqa: BLE001 - the rule's own code may raise anything: say where
            raise RuleError(f"exit rule {rule.kind} fails on the exported blocks "
                            f"({'composed' if compose else 'block by block'}): {type(err).__name__}: {err}") from None
        forms.append(runner.form)
        bad = ok & ((route.label != ref.label) | (route.exit_ramp != ref.exit_ramp)
                    | ~np.all(np.abs(route.probs - ref.probs) <= PROBS_ATOL, axis=1))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise RuleError(
                f"exit rule {rule.kind}: the exported model ({runner.form}) answers {int(bad.sum())} of {count} "
                f"example inputs unlike PyTorch; input {i}: label {route.label[i]} at ramp {route.exit_ramp[i]} "
                f"against {ref.label[i]} at ramp {ref.exit_ramp[i]}. A rule must decide each row from its own "
                "logits and state rows (no state kept on the rule object)")
    return RuleParity(inputs=count, ties=int((~ok).sum()), forms=tuple(forms))

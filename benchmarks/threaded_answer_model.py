"""The threaded-answer probe's models (``benchmarks/threaded_answer_probe.py``): one Triton Python model per
variant, written from one template. Standard library only: the probe imports it on a bare GPU host before the
project's namespace exists."""

from __future__ import annotations

from pathlib import Path

__all__ = ["VARIANTS", "DEFAULT_VARIANTS", "ENGINE_OF", "UNREQUESTED", "WIDTH", "MODEL_PY", "model_name", "write_probe_model"]

# name -> (where the sender is taken, torch in the stub); the ones expected to hold first, so a run cut short
# has measured them
VARIANTS = {
    "execute-numpy": ("execute", False),
    "execute-torch": ("execute", True),
    "thread-numpy": ("thread", False),
    "thread-torch": ("thread", True),
    "engine-torch": ("execute", True),
    "engine-sends-torch": ("execute", True),
    "unrequested-torch": ("execute", True),
}
# the engine variants: an engine thread keeps the device busy (a step and its sync every millisecond, as the
# device router's pipeline) while answers leave through a second thread ("split", the device router's shape until
# the H100 run of 2026-11-27) or through the engine thread itself, between its steps ("sends")
# what a run probes unless told (the standing GPU run's first step: about a minute on a GPU host); the engine and
# unrequested variants are the diagnosis of 2026-11-27, probed by name
DEFAULT_VARIANTS = ("execute-numpy", "execute-torch", "thread-numpy", "thread-torch")
ENGINE_OF = {"engine-torch": "split", "engine-sends-torch": "sends", "unrequested-torch": "sends"}
# variants whose responses also carry an output the client did not ask for (the load asks for ``label`` only;
# the device router's responses carried all three outputs while the side-by-side's load asked for one)
UNREQUESTED = ("unrequested-torch",)
WIDTH = 16   # input features; the label is argmax over them

MODEL_PY = '''import faulthandler
import os
import queue
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

SENDER = "{sender}"   # where each request's response sender is taken: "execute" or "thread"
USE_TORCH = {torch}
ENGINE = "{engine}"   # "": one answering thread; "split": an engine thread and a sending thread; "sends": the engine sends
EXTRA = {extra}   # every response also carries "probs", which no client asks for


class TritonPythonModel:
    """Answers from one thread after execute returns None; a second thread polls every 50 us."""

    def initialize(self, args):
        faulthandler.enable()
        self.stopping = threading.Event()
        torch_info = "no"
        if USE_TORCH:
            import torch
            self.torch = torch
            if args["model_instance_kind"] == "GPU":
                self.device = torch.device("cuda:" + str(args["model_instance_device_id"]))
                torch.cuda.set_device(self.device)
            else:
                torch.set_num_threads(1)
                self.device = torch.device("cpu")
            self.w = torch.eye({width}, device=self.device)   # x @ I: the answer is numpy's argmax
            torch_info = "%s cuda=%s" % (torch.__version__, torch.cuda.is_available())
        print("PROBE %s pid=%d python=%s torch=%s kind=%s device=%s sender=%s" % (
            args["model_name"], os.getpid(), sys.version.split()[0], torch_info.replace(" ", ","),
            args["model_instance_kind"], args["model_instance_device_id"], SENDER), file=sys.stderr, flush=True)
        self.outbox = queue.Queue()
        self.sends = queue.Queue()
        self.sending = threading.Thread(target=self.send_loop, name="probe-send", daemon=True)
        if ENGINE == "split":
            self.sending.start()
        self.answering = threading.Thread(target=self.engine if ENGINE else self.answer, name="probe-answer",
                                          daemon=True)
        self.polling = threading.Thread(target=self.poll, name="probe-poll", daemon=True)
        self.answering.start()
        self.polling.start()

    def labels(self, x):
        if not USE_TORCH:
            return np.argmax(x, axis=1).astype(np.int64)[:, None]
        t = self.torch.from_numpy(x).to(self.device)
        return self.torch.argmax(t @ self.w, dim=1).to(self.torch.int64)[:, None].cpu().numpy()

    def send_label(self, sender, part):
        """One request's answer with the FINAL flag (and an output nobody asked for where EXTRA says so)."""
        outputs = [pb_utils.Tensor("label", part)]
        if EXTRA:
            outputs.append(pb_utils.Tensor("probs", np.ones((len(part), 2), np.float32)))
        sender.send(pb_utils.InferenceResponse(outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def answer(self):
        while True:
            batch = self.outbox.get()
            if batch is None:
                return
            labels = self.labels(np.concatenate([x for _, x in batch]))
            start = 0
            for handle, x in batch:
                sender = handle if SENDER == "execute" else handle.get_response_sender()
                self.send_label(sender, labels[start:start + len(x)])
                start += len(x)
            if SENDER == "execute":   # nothing keeps a sender past its answer (serving.triton_io.ResponseSender)
                batch = handle = sender = x = None

    def engine(self):
        """A device step and its sync every millisecond, busy or not; each batch's answers sent here ("sends")
        or handed to the sending thread ("split")."""
        busy = self.torch.ones((256, 256) if self.device.type == "cuda" else (32, 32), device=self.device)
        while True:
            try:
                batch = self.outbox.get(timeout=0.001)
            except queue.Empty:
                batch = ()
            if batch is None:
                self.sends.put(None)
                return
            (busy @ busy).sum().item()
            if not batch:
                continue
            labels = self.labels(np.concatenate([x for _, x in batch]))
            start = 0
            for sender, x in batch:
                part = labels[start:start + len(x)]
                start += len(x)
                if ENGINE == "sends":
                    self.send_label(sender, part)
                else:
                    self.sends.put((sender, part))
            batch = sender = x = None

    def send_loop(self):
        while True:
            item = self.sends.get()
            if item is None:
                return
            self.send_label(*item)
            item = None

    def poll(self):
        a = np.ones((64, 16), np.float32)
        while not self.stopping.is_set():
            (a @ a.T).sum()
            time.sleep(0.00005)

    def execute(self, requests):
        batch = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "x").as_numpy().copy()
            batch.append((r.get_response_sender() if SENDER == "execute" else r, x))
        requests = r = None
        self.outbox.put(batch)
        return None

    def finalize(self):   # as the router's: send what is queued, stop the threads
        self.outbox.put(None)
        self.answering.join(timeout=5)
        if ENGINE == "split":
            self.sending.join(timeout=5)
        self.stopping.set()
        self.polling.join(timeout=5)
'''


def model_name(variant: str) -> str:
    """The Triton model serving ``variant`` (``execute-numpy`` -> ``probe_execute_numpy``)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    return "probe_" + variant.replace("-", "_")


def write_probe_model(repo: Path, kind: str, variant: str = "execute-numpy") -> str:
    """The probe model of ``variant`` in ``repo`` (instance kind ``cpu`` or ``gpu``); returns its name."""
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"--kind must be cpu or gpu, got {kind!r}")
    name = model_name(variant)
    sender, torch = VARIANTS[variant]
    d = Path(repo) / name
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "1" / "model.py").write_text(MODEL_PY.format(sender=sender, torch=torch, width=WIDTH,
                                                            engine=ENGINE_OF.get(variant, ""),
                                                            extra=variant in UNREQUESTED))
    gpus = " gpus: [0]" if kind == "gpu" else ""
    (d / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 1024\n'
        f'input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]\n'
        'output [ { name: "label" data_type: TYPE_INT64 dims: [ 1 ] }'
        + (', { name: "probs" data_type: TYPE_FP32 dims: [ 2 ] }' if variant in UNREQUESTED else '') + ' ]\n'
        f'instance_group [ {{ count: 1 kind: KIND_{kind.upper()}{gpus} }} ]\n'
        'dynamic_batching { max_queue_delay_microseconds: 0 }\n')
    return name

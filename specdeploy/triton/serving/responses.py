"""How the CPU `tensorrt_llm` model answers: through each request's response sender (which
outlives execute()), in TensorRT-LLM's output shapes. Streaming (decoupled only, as in TensorRT-LLM):
each accepted group of tokens is sent as soon as the verifier accepts it (several tokens in one
response when several drafts were accepted), then a final response without tokens and the FINAL
flag; otherwise one response holds every token. With return_perf_metrics every response carries
the perf outputs as of that response (metrics.perf_tensors).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np

from specdeploy.triton.serving.metrics import perf_tensors
from specdeploy.triton.serving.stub import pb_utils

if TYPE_CHECKING:
    from specdeploy.triton.serving.requests import Entry


def error_text(err: Exception) -> str:
    """A SpecDeployError's message and hint on one line (what the client sees)."""
    return str(err).replace("\n  hint:", "; hint:")


class Sink:
    """Where a request's responses go: its response sender, which outlives execute(). A
    non-decoupled model may send exactly one response (with the FINAL flag) through it. A
    batched request's rows share it: only the last row's final response carries the FINAL flag."""

    def __init__(self, request) -> None:
        self.sender = request.get_response_sender()
        self.open = 1  # rows still to give their final response
        self.lock = threading.Lock()  # rows end on the scheduler thread, refusals on execute()'s

    def expect(self, rows: int) -> None:
        self.open = rows

    def send(self, tensors: list, final: bool) -> None:
        self._send(pb_utils.InferenceResponse(output_tensors=tensors), final)

    def error(self, message: str) -> None:
        """One row's error, its final response."""
        self._send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), True)

    def refuse(self, message: str) -> None:
        """The whole request refused before any of its rows was queued: its one and final response."""
        self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)),
                         flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _send(self, response, final: bool) -> None:
        with self.lock:
            self.open -= final
            last = final and self.open == 0
        self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)

    def cancelled(self) -> bool:
        """The client went away or cancelled."""
        return self.sender.is_cancelled()


class Streamer:
    """Sends each accepted group at once; holds back tokens that end inside a UTF-8 character
    so the postprocessing model (which decodes each response without the next one's bytes)
    never emits a broken one."""

    def __init__(self, tokenizer, entry: Entry) -> None:
        self.tokenizer = tokenizer
        self.entry = entry
        self.pending: list[int] = []
        self.generated = 0  # tokens accepted so far, sent or held back

    def on_tokens(self, group: list[int]) -> None:
        self.pending += group
        self.generated += len(group)
        if self.tokenizer.decode(self.pending).endswith("\ufffd"):
            return
        self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.entry.sink.send(outputs(self.entry, self.pending, self.generated), final=False)
        self.pending = []


def outputs(entry: Entry, tokens: list[int], generated: int) -> list:
    """One response's tensors, in TRT-LLM's shapes: output_ids [1, beam 1, n], sequence_length
    [1, 1], batch_index [1, 1] for a row of a batched request, the token counts [1, 1] and the perf
    outputs [1, 1] each (when asked for), the latter as of `generated` new tokens."""
    def one(name: str, value: int) -> object:
        return pb_utils.Tensor(name, np.array([[value]], dtype=np.int32))

    ids = np.array(tokens, dtype=np.int32).reshape(1, 1, len(tokens))
    tensors = [pb_utils.Tensor("output_ids", ids), one("sequence_length", len(tokens))]
    if entry.batch_index is not None:
        tensors.append(one("batch_index", entry.batch_index))
    # as TensorRT-LLM's backend counts them (model_instance_state.cc): the prompt's tokens, and the
    # token ids in this response's output_ids (the prompt's too where they are repeated)
    count_input, count_output = entry.counts
    if count_input:
        tensors.append(one("num_input_tokens", len(entry.prompt)))
    if count_output:
        tensors.append(one("num_output_tokens", len(tokens)))
    return tensors + (perf_tensors(entry, generated) if entry.perf else [])

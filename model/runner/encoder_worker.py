"""The worker of an encoder embedding model: each step's sequences are whole inputs (the engine
runs with EngineConfig.whole_prompts), read in one bidirectional forward and pooled.

It keeps no KV storage: the scheduler's cells for a step's rows are bookkeeping only and are
freed when the embedding requests finish in the same step's update.
"""

from __future__ import annotations

import threading

import numpy as np

from model.layers.encoder import Encoder
from model.layers.gemma_encoder import GemmaEncoder
from model.runner.worker import set_torch_threads
from scheduler.plan import BatchPlan, StepOutput


class EncoderWorker:
    kv_bytes = 0  # no cache

    def __init__(self, encoder: Encoder | GemmaEncoder, threads: int | None = None) -> None:
        """`threads`: torch's CPU threads, set in the thread that runs the steps (see
        model.runner.worker.set_torch_threads); None leaves torch's setting."""
        self.encoder = encoder
        self.threads = threads
        self._threads_set_in: int | None = None

    def execute(self, plan: BatchPlan) -> StepOutput:
        if self.threads is not None and self._threads_set_in != threading.get_ident():
            set_torch_threads(self.threads)
            self._threads_set_in = threading.get_ident()
        if not plan.samples:  # pending cache work only: an encoder has none to apply
            return StepOutput(token_ids=[])
        by_end = {sb.end - 1: sb for sb in plan.seqs}
        inputs = []
        for sample in plan.samples:
            sb = by_end.get(sample.row)
            if not sample.embed or sb is None or int(plan.positions[sb.start]) != 0:
                raise ValueError(
                    "an encoder embeds whole inputs only (one embedding row per sequence, "
                    "from position 0)"
                )
            inputs.append(plan.token_ids[sb.start : sb.end].tolist())
        vectors = self.encoder.embed(inputs)
        embeddings: list[np.ndarray | None] = list(vectors)
        return StepOutput(token_ids=[-1] * len(inputs), embeddings=embeddings)

"""Stages sharing a host share its cores: a stage computes a micro-batch with its share of the threads while others
are in flight, and with every core when the gateway says it is alone in the pipeline (the other stages idle). The
compiled decode step has graphs for both counts (inductor specialises its kernels to the thread count).
In-process: a real StageWorker over inproc sockets, a tiny GGUF."""

from __future__ import annotations

import itertools

import pytest
import torch

from benchmarks.tiny_gguf import TinySpec, write_tiny_gguf
from services.stage.io import StageIO
from services.stage.worker import StageIdentity, StageWorker
from shared.gguf_loader import GgufLoader
from shared.layers import LayerRange
from shared.protocol import BatchResult, ForwardBatch, SeqEntry
from shared.runtime import StageRuntime
from shared.steps import Decode, Prefill
from shared.transport import ZmqTransport

_ports = itertools.count()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return write_tiny_gguf(str(tmp_path_factory.mktemp("threads") / "tiny.gguf"), TinySpec(arch="llama"))


def test_a_micro_batch_alone_in_the_pipeline_uses_the_alone_thread_count(tiny_path):
    loader = GgufLoader(tiny_path)
    runtime = StageRuntime.load(loader, None, torch.float32, kv_slots=2, max_seq_len=64)
    n = next(_ports)
    io = StageIO(ZmqTransport(f"inproc://threads-{n}", f"inproc://threads-out-{n}", accept=(ForwardBatch,), keys=None))
    layers = runtime.model.config.num_layers
    identity = StageIdentity("tiny", loader.fingerprint, LayerRange(0, layers), layers, runtime.model.position,
                             "float32")
    worker = StageWorker(runtime, io, identity, slot_lease_s=0, threads=(1, 2))
    try:
        def compute(batch: ForwardBatch) -> int:
            """Compute on the worker's compute thread; the torch thread count that thread computed with."""
            out = worker.compute_thread.submit(worker.compute, batch).result()
            assert isinstance(out, BatchResult), out
            return worker.compute_thread.submit(torch.get_num_threads).result()

        used = [compute(ForwardBatch(1, [SeqEntry("a", Prefill(5, 0, 5, True))], tokens=torch.arange(1, 6),
                                     in_flight=3))]
        for k, in_flight in enumerate((1, 2, 1)):
            used.append(compute(ForwardBatch(2 + k, [SeqEntry("a", Decode(5 + k))], tokens=torch.tensor([7]),
                                             in_flight=in_flight)))
        assert used == [1, 2, 1, 2]
        info = worker.info()
        assert (info["threads"], info["threads_alone"]) == (1, 2)
    finally:
        worker.compute_thread.shutdown()
        io.transport.close()


@pytest.mark.slow
def test_the_compiled_step_has_graphs_for_each_thread_count_a_stage_uses(tiny_path):
    """A stage decodes with its share of the threads or with all of them (alone in the pipeline): its compiled step has
    graphs for both, compiled up front, and each gives the eager step's logits at that count. A count it was not
    compiled for decodes eagerly, without compiling while serving and without giving the compiled step up."""
    loader = GgufLoader(tiny_path)
    ids = torch.arange(3, 40)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runtimes = {mode: StageRuntime.load(loader, None, torch.float32, kv_slots=2, max_seq_len=64,
                                            compile_decode=mode, thread_counts=(1, 2)) for mode in ("off", "on")}
        compiled = runtimes["on"].compiled
        assert compiled.thread_counts == (1, 2) and torch.get_num_threads() == 1
        logits = {}
        for mode, runtime in runtimes.items():
            runtime.run([SeqEntry("a", Prefill(20, 0, 20, True))], token_ids=ids[:20])
            steps = []
            for k in range(12):
                torch.set_num_threads((1, 2, 3)[k % 3])
                steps.append(runtime.run([SeqEntry("a", Decode(20 + k))], token_ids=ids[20 + k:21 + k]))
            logits[mode] = torch.cat(steps)
    finally:
        torch.set_num_threads(before)
    info = runtimes["on"].compiled_decode_info()
    assert (info["steps"], info["threads"], info["fell_back_to_eager"]) == (8, [1, 2], False), info
    eager = logits["off"]
    assert eager.abs().max() > 1 and not torch.equal(eager[0], eager[-1])
    torch.testing.assert_close(logits["on"], eager, rtol=1e-5, atol=1e-4)

"""Stages sharing a host share its cores: a stage computes a micro-batch with its share of the threads while others
are in flight, and with every core when the gateway says it is alone in the pipeline (the other stages idle). The
compiled decode step has graphs for both counts (inductor specialises its kernels to the thread count).
In-process: a real StageWorker over inproc sockets, a tiny GGUF."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.stage.io import StageIO
from services.stage.worker import StageIdentity, StageWorker
from shared.batch.steps import Decode, Prefill
from shared.files.gguf_loader import GgufLoader
from shared.files.layers import LayerRange
from shared.runtime.stage_runtime import StageRuntime
from shared.wire.protocol import BatchResult, ForwardBatch, SeqEntry
from shared.wire.transport import ZmqTransport

_ports = itertools.count()


@pytest.mark.parametrize("batch_invariant,expected", [(False, [1, 2, 1, 2]), (True, [1, 1, 1, 1])],
                         ids=["default", "batch-invariant"])
def test_a_micro_batch_alone_in_the_pipeline_uses_the_alone_thread_count(tiny_path, batch_invariant, expected):
    """Threads (1, 2): the first count beside other micro-batches in flight, the second alone in the pipeline -- except
    on a batch-invariant stage, which never switches: torch's kernels (its attention) sum in another order on another
    thread count, and its numbers must not depend on what else is in flight. /info says what it uses."""
    loader = GgufLoader(tiny_path)
    runtime = StageRuntime.load(loader, None, torch.float32, kv_slots=2, max_seq_len=64, batch_invariant=batch_invariant)
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
        assert used == expected
        info = worker.info()
        assert (info.threads, info.threads_alone) == (1, max(expected))
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


async def test_releasing_and_keeping_prefixes_run_on_the_compute_thread(tiny_path):
    """Keeping a finished sequence as a cached prefix copies its K/V (torch). Run on the event loop's thread, that
    copy started a second OpenMP team beside the compute thread's, and every later decode step of the stage ran about
    twice as slow (libgomp's threads then sleep between parallel regions instead of spinning). Every torch op of the
    stage runs on its compute thread."""
    import asyncio
    import threading

    from shared.wire.protocol import ReleaseDone, ReleaseSeqs

    loader = GgufLoader(tiny_path)
    runtime = StageRuntime.load(loader, None, torch.float32, kv_slots=4, max_seq_len=64)
    n = next(_ports)
    stage_in, gateway_in = f"inproc://keep-stage-{n}", f"inproc://keep-gateway-{n}"
    io = StageIO(ZmqTransport(stage_in, gateway_in, accept=(ForwardBatch, ReleaseSeqs), keys=None))
    layers = runtime.model.config.num_layers
    identity = StageIdentity("tiny", loader.fingerprint, LayerRange(0, layers), layers, runtime.model.position,
                             "float32", listen=stage_in)
    worker = StageWorker(runtime, io, identity, slot_lease_s=0)
    threads: dict[str, list[str]] = {"keep": [], "release": []}
    for name in threads:
        def record(seq_id, name=name, original=getattr(runtime, name)):
            threads[name].append(threading.current_thread().name)
            return original(seq_id)
        setattr(runtime, name, record)
    gateway = ZmqTransport(gateway_in, stage_in, accept=(BatchResult, ReleaseDone), keys=None)
    loop_task = asyncio.create_task(worker.run())
    try:
        for seq in ("a", "b"):
            await gateway.send(ForwardBatch(1, [SeqEntry(seq, Prefill(5, 0, 5, True))], tokens=torch.arange(1, 6)))
            assert isinstance(await asyncio.wait_for(gateway.receive(), 30), BatchResult)
        await gateway.send(ReleaseSeqs(["b"], keep=["a"]))
        assert isinstance(await asyncio.wait_for(gateway.receive(), 30), ReleaseDone)
    finally:
        loop_task.cancel()
        await asyncio.gather(loop_task, return_exceptions=True)
        gateway.close()
        io.transport.close()
    assert runtime.kv.kept_slots == 1 and runtime.kv.used_slots == 0
    assert threads["keep"] and threads["release"], threads
    assert all(t.startswith("compute") for t in threads["keep"] + threads["release"]), threads


async def _until(condition, timeout: float = 10.0) -> None:
    import asyncio
    import time
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("prefetch", [True, False])
async def test_the_loop_hands_the_compute_thread_at_most_its_bound_and_reads_on_when_one_finishes(prefetch):
    """The loop's reader hands inputs to the compute thread up to depth prefetched plus the one computing (one with
    prefetch off); the rest wait in the socket. Each input the compute thread finishes lets one more in, in order."""
    import asyncio
    import threading

    n = next(_ports)
    stage_in, upstream_in = f"inproc://bound-stage-{n}", f"inproc://bound-up-{n}"
    io = StageIO(ZmqTransport(stage_in, upstream_in, accept=(ForwardBatch,), keys=None), prefetch=prefetch, depth=2)
    upstream = ZmqTransport(upstream_in, stage_in, accept=(BatchResult,), keys=None)
    limit = 3 if prefetch else 1
    try:
        await io.start()
        for mb in range(6):
            await upstream.send(ForwardBatch(mb, [SeqEntry("a", Decode(mb + 1))], tokens=torch.tensor([mb])))
        await _until(lambda: io.handed == limit)
        await asyncio.sleep(0.2)
        assert (io.handed, io.queue_depth) == (limit, limit)  # nothing past the bound, though six are waiting
        taken = []
        for _ in range(6 - limit):
            taken.append(io.inputs.get_nowait().mb_id)
            threading.Thread(target=io.finish_one).start()  # as the compute thread does, from another thread
            await _until(lambda: io.handed == limit + len(taken))
        await asyncio.sleep(0.2)
        assert io.handed == 6
        taken += [io.inputs.get_nowait().mb_id for _ in range(limit)]
        assert taken == list(range(6))
    finally:
        await io.stop()
        upstream.close()
        io.transport.close()


def test_a_send_the_next_hop_takes_nothing_of_is_dropped_after_the_patience_and_counted(caplog):
    """The compute thread sends into ZeroMQ's queue for the next hop. With the next hop gone, that queue fills; a send
    then waits the patience, and the output is dropped, counted and logged, instead of blocking the stage forever; a stage
shutting down stops the wait at once."""
    import threading
    import time

    from shared.wire.transport import HIGH_WATER_MARK

    n = next(_ports)
    transport = ZmqTransport(f"inproc://drop-stage-{n}", f"inproc://drop-nobody-{n}", accept=(ForwardBatch,), keys=None)
    try:
        batch = ForwardBatch(1, [SeqEntry("a", Decode(3))], tokens=torch.tensor([7]))
        sent = 0
        while transport.send_from_thread(batch, patience_s=0.2):
            sent += 1
            assert sent <= 4 * HIGH_WATER_MARK, "the queue to a next hop that is not there never filled"
        t0 = time.monotonic()
        assert not transport.send_from_thread(batch, patience_s=0.2)
        assert time.monotonic() - t0 >= 0.15
        assert sent >= HIGH_WATER_MARK and transport.stats.dropped == 2
        assert "the next hop took nothing for 0.2 s" in caplog.text
        # a stage shutting down does not wait out the patience
        results = []
        waiting = threading.Thread(target=lambda: results.append(transport.send_from_thread(batch, patience_s=30)))
        t0 = time.monotonic()
        waiting.start()
        time.sleep(0.2)
        transport.stop_waiting()
        waiting.join(5)
        assert results == [False] and time.monotonic() - t0 < 2
    finally:
        transport.close()

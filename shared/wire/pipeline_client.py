"""PipelineClient: pushes micro-batches into stage 0 and matches the last stage's results by micro-batch id."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence

import zmq.asyncio

from shared.errors import StagemeshError
from shared.observe.log_throttle import throttled
from shared.wire.mesh_keys import SocketKeys
from shared.wire.protocol import (
    BatchError,
    BatchResult,
    ForwardBatch,
    KVParcel,
    ReleaseDone,
    ReleaseSeqs,
    Resplit,
)
from shared.wire.transport import ZmqTransport, hand_over

log = logging.getLogger("stagemesh.client")


class PipelineError(StagemeshError):
    """A stage failed a micro-batch; `code` is the stage's machine-readable error code (shared.errors)."""

    def __init__(self, error: BatchError):
        super().__init__(f"{error.stage}: {error.message}")
        self.error = error
        self.code = error.code


class PipelineClient:
    """One pipeline's sockets seen from the gateway (the engine's Pipeline holds one): first stage's input address,
    and our bound result address. `keys`:
    the gateway's CURVE keys (KeySet.for_gateway), or None for plaintext -- always said explicitly."""

    def __init__(self, first_stage: str, result_listen: str, *, keys: SocketKeys | None,
                 ctx: zmq.asyncio.Context | None = None):
        self.transport = ZmqTransport(result_listen, first_stage,
                                      accept=(BatchResult, BatchError, ReleaseDone, Resplit, KVParcel), keys=keys, ctx=ctx)
        self._pending: dict[int, asyncio.Future] = {}
        self._mb_ids = itertools.count(1)
        self.releases_acknowledged = 0  # sequences the last stage confirmed released
        self.unexpected = 0  # results and errors for micro-batches not in flight, dropped (the gateway's metrics read it)
        self._tasks: list[asyncio.Task] = []
        self._resplit: tuple[int, str, asyncio.Future] | None = None  # the re-split phase in flight: (rid, phase, answer)
        self._rids = itertools.count(1)
        self.parcels_relayed = 0  # re-splits' K/V parcels passed on around the ring (to an upstream stage)

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive_loop(), name="pipeline-results"),
                       asyncio.create_task(self.transport.watch_handshakes(), name="pipeline-handshakes")]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(StagemeshError("pipeline client closed"))
        self.transport.close()

    def next_mb_id(self) -> int:
        return next(self._mb_ids)

    @property
    def in_flight(self) -> int:
        """Micro-batches sent and not yet answered."""
        return len(self._pending)

    async def submit(self, batch: ForwardBatch) -> asyncio.Future:
        """Send a micro-batch; the returned future resolves to its BatchResult (or raises PipelineError)."""
        fut = asyncio.get_running_loop().create_future()
        self._pending[batch.mb_id] = fut
        try:
            await self.transport.send(batch)
        except Exception:
            self._pending.pop(batch.mb_id, None)
            raise
        return fut

    async def forward(self, batch: ForwardBatch) -> BatchResult:
        return await (await self.submit(batch))

    def abandon(self, mb_id: int) -> None:
        """Stop waiting for a micro-batch (e.g. after a stage died); a late result is ignored."""
        fut = self._pending.pop(mb_id, None)
        if fut and not fut.done():
            fut.cancel()

    async def release(self, seq_ids: list[str], keep: list[str] = ()) -> None:
        """Free these sequences' KV slots on every stage (fire and forget; the ack is counted); `keep`: finished
        sequences whose slots stay, as cached prefixes."""
        if seq_ids or keep:
            await self.transport.send(ReleaseSeqs(list(seq_ids), keep=list(keep)))

    async def release_all(self, spare: Sequence[str] = ()) -> None:
        """Free every KV slot the stages hold (reconcile): only for a client that owns no sequence yet, e.g. a
        gateway at start, taking back what a gateway before it (SIGKILLed, say) left behind -- except `spare`,
        the sequences it re-adopts where they are."""
        await self.transport.send(ReleaseSeqs([], everything=True, spare=list(spare)))

    def reroute(self, first_stage: str) -> None:
        """Send into `first_stage` from now on (a stage process there took the first place)."""
        self.transport.reroute(first_stage)

    def next_rid(self) -> int:
        return next(self._rids)

    async def resplit(self, msg: Resplit, via: str | None = None) -> Resplit:
        """Send one phase of a live re-split through the pipeline and wait for it to come back (every stage did its
        part, or the message names the one that refused). Meanwhile the K/V parcels that come round to the gateway
        (for an upstream stage) are passed on into the first stage, ahead of anything sent after them. The caller
        bounds the wait (the phase is then lost: it aborts or declares the pipeline lost). `via`: a first stage's
        address to send into instead of the route's, on a socket of its own once the handshake with the first
        stage's key completed there (hand_over: a replacement's probe); the message comes back with the error
        when it did not."""
        fut = asyncio.get_running_loop().create_future()
        self._resplit = (msg.rid, msg.phase, fut)
        try:
            if via is None:
                await self.transport.send(msg)
            elif (why := await asyncio.to_thread(hand_over, via, self.transport.keys, msg)) is not None:
                msg.error = f"the gateway: {why}"
                return msg
            return await fut
        finally:
            self._resplit = None

    async def _relay(self, parcel: KVParcel) -> None:
        if self._resplit is None or self._resplit[0] != parcel.rid:
            throttled(log, logging.INFO, "parcel", "dropped K/V of %r for re-split %d, which is not running",
                      parcel.seq_id, parcel.rid)
            return
        await self.transport.send(parcel)
        self.parcels_relayed += 1

    async def _receive_loop(self) -> None:
        while True:
            msg = await self.transport.receive()
            if isinstance(msg, ReleaseDone):
                self.releases_acknowledged += len(msg.seq_ids)
                continue
            if isinstance(msg, KVParcel):
                await self._relay(msg)
                continue
            if isinstance(msg, Resplit):
                want = self._resplit
                if want is not None and (msg.rid, msg.phase) == want[:2] and not want[2].done():
                    want[2].set_result(msg)
                else:
                    throttled(log, logging.INFO, "resplit", "dropped re-split %d's %s, which is not awaited",
                              msg.rid, msg.phase)
                continue
            fut = self._pending.pop(msg.mb_id, None)
            if fut is None or fut.done():  # abandoned after a failover, or never ours: never acted on
                self.unexpected += 1
                throttled(log, logging.INFO, "unexpected", "dropped a %s for micro-batch %s, which is not in flight "
                          "(abandoned after a failover, or forged)", type(msg).__name__, msg.mb_id)
                continue
            if isinstance(msg, BatchError):
                fut.set_exception(PipelineError(msg))
            else:
                fut.set_result(msg)

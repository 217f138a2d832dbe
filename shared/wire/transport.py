"""ZeroMQ transport: every receiver binds a PULL, every sender connects a PUSH. Frames go out with copy=False
and come in as zmq.Frame buffers viewed as tensors. Malformed input is counted and dropped here, at the edge.

With keys (shared.wire.mesh_keys.SocketKeys) both sockets use CURVE: the PULL is a CURVE server that a ZAP handler lets
only its one upstream peer's key into, the PUSH a CURVE client of the next hop's key. A connection with any other key
never completes its handshake, so nothing it sends is ever received. Without keys (--insecure-plaintext) the
sockets are plaintext and open to anyone who can reach them."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import threading
import time

import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from shared.config import check_address
from shared.errors import StagemeshError
from shared.observe.log_throttle import throttled
from shared.wire.mesh_keys import SocketKeys
from shared.wire.protocol import MAX_HEADER_BYTES, MAX_TENSOR_BYTES, Message, ProtocolError, decode, encode

log = logging.getLogger("stagemesh.transport")

HIGH_WATER_MARK = 64  # messages queued per socket before a send waits
SEND_PATIENCE_S = 30.0  # how long send_from_thread waits on a full queue before it drops the message
# socket monitor events of a failed ZMTP/CURVE handshake: a peer with another key set, a plaintext peer, an impostor
HANDSHAKE_FAILURES = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
                      zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth"}


def _bind_with_retry(sock: zmq.Socket, addr: str, patience_s: float = 3.0) -> None:
    """Bind, waiting briefly if a socket that just closed has not released the address yet (ZMQ closes
    asynchronously); a port held by someone else still fails with a clear error."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise StagemeshError(f"cannot bind {addr}: {e}") from None
            if time.monotonic() > deadline:
                raise StagemeshError(f"cannot bind {addr}: address already in use; choose another port") from None
            time.sleep(0.05)


class TransportStats:
    """What one transport counts (bytes, time spent sending, rejects by reason, failed handshakes): written only by
    the transport, part of its owner's ledger (a stage's StageStats, the gateway's result-port collector)."""

    def __init__(self):
        self.bytes_in = 0
        self.bytes_out = 0
        self.sending_seconds = 0.0  # encoding and handing messages to the next hop (a full queue makes it wait)
        self.dropped = 0  # messages send_from_thread gave up on: the next hop's queue stayed full (SEND_PATIENCE_S)
        self.rejected: dict[str, int] = {}
        # failed handshakes per socket: "out" (our PUSH dialling the next hop: the peer there holds another key
        # set) is evidence about the mesh; "in" (anyone who can reach our port) is only counted
        self.handshakes_failed = {"in": 0, "out": 0}

    def reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


class _OnePeer:
    """ZAP credentials for one receiving socket: exactly one client key is let in; every refusal is counted."""

    def __init__(self, key: bytes, name: str, stats: TransportStats):
        self.key, self.name, self.stats = key, name, stats
        # in a mesh that changes its members: the upstream's own upstream too (a member that vanishes is routed
        # around without a message reaching this receiver first), and during a change the upstream-to-be
        self.also: frozenset[bytes] = frozenset()

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self.key or client_key in self.also:
            return True
        self.stats.reject("auth")
        throttled(log, logging.WARNING, "denied:auth", "refused a CURVE connection with key %s on %s: only %s's key "
                  "is accepted there", client_key.decode(errors="replace")[:8] + "...", domain, self.name)
        return False


class Zap:
    """The ZAP handler of one ZeroMQ context (libzmq asks inproc://zeromq.zap.01 of the socket's own context), run
    in a thread so it answers whatever event loop the sockets live on. Each CURVE receiver gets its own domain."""

    _lock = threading.Lock()
    _by_context: dict[zmq.Context, Zap] = {}
    _domains = itertools.count(1)

    def __init__(self, ctx: zmq.Context):
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("stagemesh.zap"))
        self.auth.start()

    @classmethod
    def add(cls, ctx: zmq.Context, peer: _OnePeer) -> str:
        with cls._lock:
            zap = cls._by_context.get(ctx)
            if zap is None:
                zap = cls._by_context[ctx] = Zap(ctx)
            domain = f"stagemesh-{next(cls._domains)}"
            zap.auth.configure_curve_callback(domain, peer)
            return domain

    @classmethod
    def peer(cls, ctx: zmq.Context, domain: str) -> _OnePeer | None:
        """The credentials a domain lets in (None: no such domain)."""
        with cls._lock:
            zap = cls._by_context.get(ctx)
            return None if zap is None else zap.auth.credentials_providers.get(domain)

    @classmethod
    def remove(cls, ctx: zmq.Context, domain: str) -> None:
        """Forget a domain. The handler itself stays for the context's next receiver (its inproc endpoint is not
        free again at once after a stop); stop() it before terminating a context of your own."""
        with cls._lock:
            zap = cls._by_context.get(ctx)
            if zap is not None:
                zap.auth.credentials_providers.pop(domain, None)

    @classmethod
    def stop(cls, ctx: zmq.Context) -> None:
        with cls._lock:
            zap = cls._by_context.pop(ctx, None)
            if zap is not None:
                zap.auth.stop()

    @classmethod
    def stop_all(cls) -> None:
        for ctx in list(cls._by_context):
            cls.stop(ctx)


atexit.register(Zap.stop_all)  # a context with a live handler would hang the interpreter's exit


async def recv_frames(sock: zmq.asyncio.Socket) -> list:
    """The next multipart message, as zmq.Frames. pyzmq's asyncio socket can be woken with POLLIN and then find
    nothing to read (seen under CURVE: the readiness event of a handshake); nothing was consumed, so wait again."""
    while True:
        try:
            return await sock.recv_multipart(copy=False)
        except zmq.Again:
            continue


def curve_receiver(ctx: zmq.Context, sock: zmq.Socket, keys: SocketKeys, stats: TransportStats) -> str:
    """Make `sock` (of `ctx`, not yet bound) a CURVE server that lets in only keys.accept; returns its ZAP domain (for
    Zap.remove when the socket closes)."""
    domain = Zap.add(ctx, _OnePeer(keys.accept, keys.accept_name, stats))  # answering before any connect
    sock.zap_domain = domain.encode()
    sock.curve_server = True
    sock.curve_publickey = keys.receive.public
    sock.curve_secretkey = keys.receive.secret
    return domain


def curve_sender(sock: zmq.Socket, keys: SocketKeys, where: str) -> None:
    """Make `sock` (not yet connected) a CURVE client of the next hop's key."""
    if keys.next_server is None:
        raise StagemeshError(f"no public key for the next hop {where}; pass the mesh's --keys DIR")
    sock.curve_serverkey = keys.next_server
    sock.curve_publickey = keys.send.public
    sock.curve_secretkey = keys.send.secret


PROBE_S = 1.0  # how long hand_over waits for the handshake at an address (loopback takes milliseconds)


def hand_over(address: str, keys: SocketKeys | None, msg: Message, timeout_s: float = PROBE_S) -> str | None:
    """Send `msg` to `address` on a PUSH of its own, and only once its handshake there completed: with keys, a CURVE
    handshake against keys.next_server as the server key, which only a process holding that key's secret can
    complete (and only one that lets keys.send in: ZAP answers before the connection is usable). None when handed
    over; else why not, within timeout_s (a failed handshake answers at once). Blocks: for a thread of the caller's
    (the gateway's loop runs it in one, a stage on its loader thread); the caller's own sockets are not touched."""
    ctx = zmq.Context()  # its own: torn down here, after the message left (LINGER)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # no pipe, so no POLLOUT, before the handshake (ZAP included) completed
    sock.setsockopt(zmq.LINGER, int(timeout_s * 1000))
    if keys is not None:
        curve_sender(sock, keys, address)
    monitor = sock.get_monitor_socket(sum(HANDSHAKE_FAILURES))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLOUT)
    poller.register(monitor, zmq.POLLIN)
    try:
        sock.connect(check_address(address, "route"))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if sock in ready:
                sock.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False)
                return None
            if monitor in ready:
                kind = HANDSHAKE_FAILURES.get(parse_monitor_message(monitor.recv_multipart())["event"])
                if kind is not None:
                    holds = (f"does not hold {keys.next_name or 'the next hop'}'s secret key (or does not let this "
                             "sender's key in)") if keys else "does not speak plaintext ZMTP"
                    return f"the {'CURVE' if keys else 'ZMTP'} handshake with {address} failed ({kind}): the process " \
                           f"there {holds}"
        return f"no process at {address} completed a handshake within {timeout_s:g} s (nothing listens there?)"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close()
        ctx.term()


class ZmqTransport:
    """An inbound PULL (bound) and an outbound PUSH (connected); `receive` returns only validated messages of the
    kinds this socket accepts. `keys` is required: SocketKeys for CURVE, or None for plaintext (callers say which)."""

    def __init__(self, listen: str, next_hop: str | None, accept: tuple[type, ...], *, keys: SocketKeys | None,
                 ctx: zmq.asyncio.Context | None = None):
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.stats = TransportStats()
        self.accept = accept
        self.keys = keys
        self._domain: str | None = None
        self.inbound = self.ctx.socket(zmq.PULL)
        self.inbound.setsockopt(zmq.MAXMSGSIZE, MAX_TENSOR_BYTES + MAX_HEADER_BYTES)
        self.inbound.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self.inbound.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            self._domain = curve_receiver(self.ctx, self.inbound, keys, self.stats)
        _bind_with_retry(self.inbound, check_address(listen, "--listen"))
        self.outbound = None
        self.next_hop = next_hop  # where the PUSH sends (reroute changes it)
        # synchronous views of the same libzmq sockets, for receive_nowait and send_from_thread
        self._inbound_sync: zmq.Socket | None = None
        self._outbound_sync: zmq.Socket | None = None
        self._stop_waiting = False
        # a mesh with replicas of the next range: instance id -> its PUSH (None: the outbound, which is connected to
        # that instance's address already) and the address it is connected to; empty in a mesh without replicas
        self.hops: dict[str, zmq.asyncio.Socket | None] = {}
        self.hop_addresses: dict[str, str] = {}
        self._hops_sync: dict[str, zmq.Socket] = {}
        if next_hop:
            self.outbound = self.ctx.socket(zmq.PUSH)
            self.outbound.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
            self.outbound.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                curve_sender(self.outbound, keys, next_hop)
            self.outbound.connect(check_address(next_hop, "--next"))

    def reroute(self, next_hop: str) -> None:
        """Send to `next_hop` from now on (a stage process there took the next place in the pipeline): the PUSH
        disconnects from the old hop, whose queued messages are dropped, and connects the new one with the same
        CURVE server key (the place's key pair, which the new process holds). Only the outbound socket's user calls
        it (a stage's compute thread, the gateway's loop)."""
        with contextlib.suppress(zmq.ZMQError):  # not connected there (never, or already gone)
            self.outbound.disconnect(self.next_hop)
        self.outbound.connect(check_address(next_hop, "route"))
        self.next_hop = next_hop

    def route_to(self, next_hop: str, server_key: bytes | None) -> None:
        """Send to `next_hop`, a process holding `server_key`, from now on, over a connection made now: the members
        of the mesh changed, and a receiver that refused this sender's key before (its handshake failed) lets it in
        now. The PUSH's CURVE server key applies to the connections it makes after it is set. Only the outbound
        socket's user calls it."""
        with contextlib.suppress(zmq.ZMQError):  # not connected there (never, or already gone)
            self.outbound.disconnect(self.next_hop)
        if self.keys is not None and server_key is not None:
            self.outbound.curve_serverkey = server_key
            self.keys = dataclasses.replace(self.keys, next_server=server_key, next_name="the next member")
        self.outbound.connect(check_address(next_hop, "route"))
        self.next_hop = next_hop

    def set_hops(self, hops: list[tuple[str, str, bytes | None]]) -> None:
        """Send to these next-hop instances (id, address, CURVE server key) by a route's id from now on, each on a PUSH
        of its own (ZeroMQ's PUSH round-robins among a socket's peers, so one socket per peer); the one at next_hop's
        address is the outbound itself; an instance held before and not named is closed (what it had queued goes).
        Only the outbound socket's user calls it."""
        wanted = {i: (a, k) for i, a, k in hops}
        for inst in [i for i in self.hops if i not in wanted or wanted[i][0] != self.hop_addresses[i]]:
            sock = self.hops.pop(inst)
            self.hop_addresses.pop(inst)
            self._hops_sync.pop(inst, None)
            if sock is not None:
                sock.close(0)
        for inst, (address, key) in wanted.items():
            if inst in self.hops:
                continue
            sock = None
            if address != self.next_hop:
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
                sock.setsockopt(zmq.LINGER, 0)
                if self.keys is not None:
                    curve_sender(sock, dataclasses.replace(self.keys, next_server=key), address)
                sock.connect(check_address(address, "hop"))
            self.hops[inst] = sock
            self.hop_addresses[inst] = address

    def accept_from(self, upstream: bytes | None, also: tuple[bytes, ...] = (), name: str = "the upstream member") \
            -> None:
        """Let in `upstream`'s key (and `also`'s) on the receiver from now on, and no other: the mesh's members
        changed. Connections already made stay until their peer leaves them (a CURVE key is checked at the
        handshake); plaintext (no keys) has nothing to change."""
        if self.keys is None or upstream is None or self._domain is None:
            return
        peer = Zap.peer(self.ctx, self._domain)
        peer.key, peer.name, peer.also = upstream, name, frozenset(k for k in also if k)
        self.keys = dataclasses.replace(self.keys, accept=upstream, accept_name=name)

    def also_accept(self, keys: tuple[bytes | None, ...]) -> None:
        """Let these keys in on the receiver as well, from now on (the instances of the range before this one: a
        replica of it joined). Plaintext (no keys) has nothing to change."""
        if self.keys is None or self._domain is None:
            return
        peer = Zap.peer(self.ctx, self._domain)
        peer.also = peer.also | frozenset(k for k in keys if k)

    async def watch_handshakes(self) -> None:
        """Count failed handshakes on both sockets (socket monitor events) until cancelled: without this a hop whose
        peer holds another key set is a silent black hole. An inbound failure that ZAP did not cause (ZAP counts its
        own refusals as "auth") is also a rejected message with reason "handshake"."""
        watched = [(d, sock) for d, sock in (("in", self.inbound), ("out", self.outbound)) if sock is not None]
        monitors = [(d, sock.get_monitor_socket(sum(HANDSHAKE_FAILURES))) for d, sock in watched]
        try:
            await asyncio.gather(*(self._count_failures(d, mon) for d, mon in monitors))
        finally:
            for (_, sock), (_, mon) in zip(watched, monitors):
                if not sock.closed:
                    sock.disable_monitor()
                mon.close(0)

    async def _count_failures(self, direction: str, monitor: zmq.asyncio.Socket) -> None:
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except zmq.Again:
                continue
            kind = HANDSHAKE_FAILURES.get(event["event"])
            if kind is None:
                continue
            self.stats.handshakes_failed[direction] += 1
            if direction == "in" and kind != "auth":
                self.stats.reject("handshake")
            where = event["endpoint"].decode(errors="replace")
            throttled(log, logging.WARNING, f"handshake:{direction}", "%s handshake failed (%s) %s %s: the peer holds "
                      "another key set, or is not part of this mesh", "CURVE" if self.keys else "ZMTP", kind,
                      "dialling" if direction == "out" else "on", where)

    async def receive(self) -> Message:
        """The next valid message; malformed ones are counted under their reason and dropped."""
        while True:
            msg = self._validated(await recv_frames(self.inbound))
            if msg is not None:
                return msg

    @property
    def inbound_fd(self) -> int:
        """The file descriptor that becomes readable when inbound may hold messages (edge-triggered: a watcher of it
        calls receive_nowait until it returns None)."""
        return self.inbound.FD

    def receive_nowait(self) -> Message | None:
        """The next valid message already waiting, or None; never waits. For a caller that watches inbound_fd on its
        event loop itself (a stage: one reader callback drains every waiting message, with no future per message),
        and never together with receive()."""
        if self._inbound_sync is None:
            self._inbound_sync = zmq.Socket.shadow(self.inbound.underlying)
        while True:
            try:
                frames = self._inbound_sync.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            msg = self._validated(frames)
            if msg is not None:
                return msg

    def _validated(self, frames: list) -> Message | None:
        """The message in frames if it is well-formed and of a kind this socket accepts; else counted under its
        reason, logged (throttled) and None."""
        size = sum(len(f) for f in frames)
        self.stats.bytes_in += size
        try:
            msg = decode(frames)
            if not isinstance(msg, self.accept):
                raise ProtocolError("kind", f"{type(msg).__name__} is not accepted on this socket")
            return msg
        except ProtocolError as e:
            self.stats.reject(e.reason)
            throttled(log, logging.WARNING, f"dropped:{e.reason}", "dropped a message of %d bytes in %d frames: %s",
                      size, len(frames), e)
            return None

    async def send(self, msg: Message) -> None:
        if self.outbound is None:
            raise StagemeshError("this transport has no next hop to send to")
        t0 = time.perf_counter()
        try:
            frames = encode(msg)
            await self.outbound.send_multipart(frames, copy=False)
            self._count_sent(frames)
        finally:
            self.stats.sending_seconds += time.perf_counter() - t0

    def send_from_thread(self, msg: Message, patience_s: float = SEND_PATIENCE_S, via: str | None = None) -> bool:
        """Send from a plain thread that is this transport's only sender (a stage's compute thread: it sends each
        output the moment it is computed, with no hand-off to the event loop). ZeroMQ's queue to the next hop takes
        the message at once unless HIGH_WATER_MARK messages wait there; then this waits up to patience_s and drops
        it (returns False, logged): the next hop has been gone that long, and the gateway's failover replays.
        `via`: the next-hop instance (one of hops) to send to; None: the outbound."""
        if self.outbound is None:
            raise StagemeshError("this transport has no next hop to send to")
        if self._outbound_sync is None:  # the same libzmq socket, driven synchronously (never also from the loop)
            self._outbound_sync = zmq.Socket.shadow(self.outbound.underlying)
        sock = self._outbound_sync
        if via is not None and self.hops[via] is not None:  # KeyError for an instance not held: the caller checks
            sock = self._hops_sync.get(via)
            if sock is None:
                sock = self._hops_sync[via] = zmq.Socket.shadow(self.hops[via].underlying)
        t0 = time.perf_counter()
        try:
            frames = encode(msg)
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not self._wait_to_send(patience_s, sock):
                    self.stats.dropped += 1
                    throttled(log, logging.WARNING, "send:full", "dropped a %s: the next hop took nothing for %g s "
                              "(%d messages queued)", type(msg).__name__, patience_s, HIGH_WATER_MARK)
                    return False
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self._count_sent(frames)
            return True
        finally:
            self.stats.sending_seconds += time.perf_counter() - t0

    def _count_sent(self, frames: list) -> None:
        self.stats.bytes_out += sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)

    def _wait_to_send(self, patience_s: float, sock: zmq.Socket) -> bool:
        """Wait until the outbound queue takes a message (True), at most patience_s, and no longer than until
        stop_waiting() is called."""
        deadline = time.monotonic() + patience_s
        while not self._stop_waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if sock.poll(int(min(left, 0.1) * 1000) + 1, zmq.POLLOUT):
                return True
        return False

    def stop_waiting(self) -> None:
        """A send waiting on a full queue (send_from_thread) gives up within 0.1 s: the owner is shutting down."""
        self._stop_waiting = True

    def close(self) -> None:
        self.inbound.close(0)
        if self.outbound is not None:
            self.outbound.close(0)
        for sock in self.hops.values():
            if sock is not None:
                sock.close(0)
        if self._domain is not None:
            Zap.remove(self.ctx, self._domain)
            self._domain = None

"""Transport cost: codec + ZeroMQ for activations of 4 KB, 1 MB and 64 MB.

    python -m benchmarks.transport [--repeat N] [--curve] [--mesh] [--hop] [--dtype D]

Prints, per size: round trip over tcp loopback (encode -> PUSH -> PULL -> decode -> PUSH back -> PULL -> decode),
encode+decode throughput against a plain memory copy of the same bytes (torch clone), and one-way ZMQ throughput.
--curve: the same round trips and one-way throughput with the mesh's CURVE sockets (encrypted, ZAP-authenticated),
measured in the same run, and the CURVE / plaintext ratio. --mesh: decode tokens/s of a 2-stage mesh (one stream,
and 4 micro-batches of 8 in flight) with CURVE and with --insecure-plaintext, rounds alternating. --dtype: the
activations' dtype, on the wire and in the mesh (default: stagemesh's). --hop: what one hop of a one-stream decode
step costs between two processes (a one-token micro-batch, as between stages), back to back and after the idle
gap a stage waits between its turns at one stream (--gap-ms): raw blocking ZeroMQ, pyzmq's asyncio sockets, and
stagemesh's codec on them (what a stage's hop runs), one-way = round trip / 2; and the codec alone in one process,
warm and after the same gap."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import torch
import zmq
import zmq.asyncio

from services.testing.harness import add_dtype_arg, dtype_label, free_port, run_groups, running_mesh
from shared.batch.steps import Decode, Prefill
from shared.models.device import resolve_dtype
from shared.wire.mesh_keys import KeyPair, SocketKeys
from shared.wire.protocol import ForwardBatch, SeqEntry, decode, encode
from shared.wire.transport import TransportStats, Zap, curve_receiver, curve_sender, recv_frames

SIZES = {"4 KB": 4 << 10, "1 MB": 1 << 20, "64 MB": 64 << 20}


def make_batch(nbytes: int, dtype: torch.dtype, hidden_size: int = 1024) -> ForwardBatch:
    """One sequence's prefill chunk whose activation [tokens, hidden] is nbytes of `dtype`."""
    rows = max(1, nbytes // (hidden_size * dtype.itemsize))
    hidden = torch.randn(rows, hidden_size).to(dtype)
    return ForwardBatch(1, [SeqEntry("s0", Prefill(rows, 0, rows, True))], hidden=hidden)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def peer_keys() -> tuple[SocketKeys, SocketKeys]:
    """In-memory keys of two peers, a and b, each accepting only the other (what a mesh's neighbours hold)."""
    a, b = (KeyPair(*zmq.curve_keypair()) for _ in range(2))
    return SocketKeys(a, b.public, "b", a, b.public, "b"), SocketKeys(b, a.public, "a", b, a.public, "a")


def sockets(ctx, curve: bool, pairs: list[tuple[str, str]]) -> list[tuple[zmq.Socket, zmq.Socket]]:
    """For each (receiver, sender) name pair a bound PULL and a PUSH connected to it, CURVE from sender to receiver
    when asked (names are 'a' or 'b': the two peers of peer_keys)."""
    keys = dict(zip("ab", peer_keys()))
    out = []
    for receiver, sender in pairs:
        addr = f"tcp://127.0.0.1:{free_port()}"
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        if curve:
            curve_receiver(ctx, pull, keys[receiver], TransportStats())
            curve_sender(push, keys[sender], addr)
        pull.bind(addr)
        push.connect(addr)
        out.append((pull, push))
    return out


def close(ctx, socks) -> None:
    for pair in socks:
        for s in pair:
            s.close(0)
    Zap.stop(ctx)
    ctx.term()


async def round_trips(batch: ForwardBatch, repeat: int, curve: bool = False) -> list[float]:
    ctx = zmq.asyncio.Context()
    socks = sockets(ctx, curve, [("a", "b"), ("b", "a")])
    (pull_a, push_to_a), (pull_b, push_to_b) = socks

    async def echo():
        while True:
            msg = decode(await recv_frames(pull_b))
            await push_to_a.send_multipart(encode(msg), copy=False)

    task = asyncio.create_task(echo())
    out = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        await push_to_b.send_multipart(encode(batch), copy=False)
        back = decode(await recv_frames(pull_a))
        out.append(time.perf_counter() - t0)
        assert torch.equal(back.hidden, batch.hidden)
    task.cancel()
    close(ctx, socks)
    return out[1:]


async def one_way(batch: ForwardBatch, repeat: int, curve: bool = False) -> float:
    ctx = zmq.asyncio.Context()
    socks = sockets(ctx, curve, [("b", "a")])
    pull, push = socks[0]
    await push.send_multipart(encode(batch), copy=False)
    decode(await recv_frames(pull))
    t0 = time.perf_counter()
    for _ in range(repeat):
        await push.send_multipart(encode(batch), copy=False)
        decode(await recv_frames(pull))
    elapsed = time.perf_counter() - t0
    close(ctx, socks)
    return repeat * batch.hidden.nbytes / elapsed


def curve_table(repeat: int, dtype: torch.dtype) -> None:
    print(f"\nCURVE vs plaintext (same run, tcp loopback): {'size':>6} | round trip plain / CURVE | "
          "one-way GB/s plain / CURVE | CURVE/plain throughput")
    for label, nbytes in SIZES.items():
        batch = make_batch(nbytes, dtype)
        reps = repeat if nbytes < (32 << 20) else max(3, repeat // 4)
        rtt = {c: statistics.median(asyncio.run(round_trips(batch, reps, c))) for c in (False, True)}
        bps = {c: asyncio.run(one_way(batch, reps, c)) for c in (False, True)}
        print(f"{'':>44}{label:>6} | {rtt[False] * 1e3:9.3f} / {rtt[True] * 1e3:9.3f} ms | "
              f"{bps[False] / 1e9:8.2f} / {bps[True] / 1e9:6.2f} | {bps[True] / bps[False]:.2f}")


def mesh_tokens(rounds: int, dtype: str | None) -> None:
    """Decode tokens/s of a 2-stage mesh, CURVE against plaintext, alternating so drift hits both alike."""
    from shared.runtime.model_files import ModelFiles

    prompt = ModelFiles.open("smollm2").tokenizer.encode("The history of the printing press begins")
    shapes = {"1 stream": (1, 1), "4x8 in flight": (4, 8)}
    runs: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for mode, plaintext in (("CURVE", False), ("plaintext", True)):
            with running_mesh("smollm2", 2, dtype, insecure_plaintext=plaintext) as mesh:
                for shape, (inflight, batch) in shapes.items():
                    r = asyncio.run(run_groups(mesh, prompt, inflight, batch, steps=40, warmup=5))
                    runs.setdefault((shape, mode), []).append(r["throughput_mb_s"] * batch)
    print(f"\n2-stage mesh, smollm2 {dtype_label(dtype)}, decode tokens/s (mean of {rounds} alternating rounds):")
    for shape in shapes:
        c, p = statistics.mean(runs[(shape, "CURVE")]), statistics.mean(runs[(shape, "plaintext")])
        print(f"  {shape:>14}: CURVE {c:7.1f}  plaintext {p:7.1f}  CURVE/plaintext {c / p:.3f}  "
              f"(runs CURVE {', '.join(f'{v:.1f}' for v in runs[(shape, 'CURVE')])}; "
              f"plaintext {', '.join(f'{v:.1f}' for v in runs[(shape, 'plaintext')])})")


# ---- --hop: one decode step's hop between two processes ----------------------------------------------------------

HOP_MODES = {"zmq": "blocking pyzmq, raw bytes", "asyncio": "pyzmq asyncio, raw bytes",
             "stagemesh": "pyzmq asyncio + stagemesh's codec"}


def decode_batch(hidden_size: int, dtype: torch.dtype) -> ForwardBatch:
    """One sequence's decode step between stages: hidden [1, hidden_size]."""
    return ForwardBatch(1, [SeqEntry("cmpl-0123456789abcdef", Decode(70))], hidden=torch.randn(1, hidden_size).to(dtype))


def echo(mode: str, listen: str, reply: str) -> None:
    """The far end of hop_round_trips (a process of its own): send back every message until an empty one."""
    if mode == "zmq":
        ctx = zmq.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(listen)
        push.connect(reply)
        while (frames := pull.recv_multipart()) != [b""]:
            push.send_multipart(frames)
        return

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(listen)
        push.connect(reply)
        while (frames := await recv_frames(pull)) and frames[0].bytes != b"":
            await push.send_multipart(encode(decode(frames)) if mode == "stagemesh" else frames, copy=False)
    asyncio.run(run())


async def hop_round_trips(mode: str, batch: ForwardBatch, repeat: int, gap_s: float) -> list[float]:
    """Round trips of `batch` to an echo process and back, `gap_s` idle before each (this end sleeps, the other
    waits in its receive, as a stage waits for its next input)."""
    listen, reply = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    peer = subprocess.Popen([sys.executable, "-m", "benchmarks.transport", "--echo", mode, listen, reply])
    ctx = zmq.asyncio.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(reply)
    push.connect(listen)
    raw = [bytes(f) for f in encode(batch)]
    out = []
    try:
        for _ in range(repeat + 10):  # the first 10 connect and warm up
            if gap_s:
                await asyncio.sleep(gap_s)
            t0 = time.perf_counter()
            if mode == "stagemesh":
                await push.send_multipart(encode(batch), copy=False)
                decode(await recv_frames(pull))
            else:
                await push.send_multipart(raw)
                await pull.recv_multipart()
            out.append(time.perf_counter() - t0)
        await push.send_multipart([b""])
        peer.wait(timeout=10)
    finally:
        peer.kill()
        pull.close(0)
        push.close(0)
        ctx.term()
    return out[10:]


def codec_times(batch: ForwardBatch, repeat: int, gap_s: float) -> tuple[float, float]:
    """Median encode and decode seconds of `batch` in this process, each after `gap_s` idle."""
    enc, dec = [], []
    for _ in range(repeat):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        frames = encode(batch)
        enc.append(time.perf_counter() - t0)
        frames = [bytes(f) for f in frames]
        time.sleep(gap_s)
        t0 = time.perf_counter()
        decode(frames)
        dec.append(time.perf_counter() - t0)
    return statistics.median(enc), statistics.median(dec)


def hop_table(repeat: int, gap_ms: float, dtype: torch.dtype, dtype_name: str) -> None:
    """The --hop table: SmolLM2's hidden size (576), each path back to back and after gap_ms idle."""
    batch = decode_batch(576, dtype)
    gaps = {"back to back": 0.0, f"after {gap_ms:g} ms idle": gap_ms / 1e3}
    print(f"\none decode step's hop between two processes (hidden [1, 576] {dtype_name}, "
          f"tcp loopback, plaintext), one-way median of {repeat} = round trip / 2:")
    for mode, what in HOP_MODES.items():
        cells = [f"{statistics.median(asyncio.run(hop_round_trips(mode, batch, repeat, g))) / 2 * 1e6:6.0f} us"
                 for g in gaps.values()]
        print(f"  {what:>36}: " + "  ".join(f"{label} {cell}" for label, cell in zip(gaps, cells)))
    print("  stagemesh's codec alone, in one process (encode / decode):")
    for label, g in gaps.items():
        e, d = codec_times(batch, repeat, g)
        print(f"  {label:>36}: {e * 1e6:6.0f} / {d * 1e6:6.0f} us")


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--echo":  # hop_round_trips' far end
        echo(*sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--curve", action="store_true", help="also measure CURVE against plaintext, same run")
    p.add_argument("--mesh", action="store_true", help="also measure a 2-stage mesh's tokens/s with and without CURVE")
    p.add_argument("--rounds", type=int, default=2, help="--mesh: alternating rounds per mode")
    p.add_argument("--hop", action="store_true", help="also measure one decode step's hop between two processes")
    p.add_argument("--gap-ms", type=float, default=6.0, help="--hop: the idle gap before each round trip "
                   "(default 6: a stage's wait while the other of two computes, at one stream)")
    add_dtype_arg(p, "the activations' (wire and --mesh)")
    args = p.parse_args()
    print(f"{'size':>6} | {'round trip (median)':>19} | {'codec GB/s':>10} | {'memcpy GB/s':>11} | {'codec/memcpy':>12} | "
          f"{'zmq one-way GB/s':>16} | {'zmq/memcpy':>10}")
    dtype = resolve_dtype(args.dtype)
    for label, nbytes in SIZES.items():
        batch = make_batch(nbytes, dtype)
        n = batch.hidden.nbytes
        reps = args.repeat if nbytes < (32 << 20) else max(3, args.repeat // 4)
        codec_s = best(lambda b=batch: decode(encode(b)), reps)
        copy_s = best(lambda b=batch: b.hidden.clone(), reps)
        rtt = statistics.median(asyncio.run(round_trips(batch, reps)))
        zmq_bps = asyncio.run(one_way(batch, reps))
        codec_gbs, copy_gbs = n / codec_s / 1e9, n / copy_s / 1e9
        print(f"{label:>6} | {rtt * 1e3:>16.3f} ms | {codec_gbs:>10.2f} | {copy_gbs:>11.2f} | {codec_gbs / copy_gbs:>12.2f} | "
              f"{zmq_bps / 1e9:>16.2f} | {zmq_bps / 1e9 / copy_gbs:>10.2f}")
    if args.curve:
        curve_table(args.repeat, dtype)
    if args.mesh:
        mesh_tokens(args.rounds, args.dtype)
    if args.hop:
        hop_table(max(args.repeat, 100), args.gap_ms, dtype, dtype_label(args.dtype))


if __name__ == "__main__":
    main()

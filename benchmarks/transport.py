"""Transport cost: codec + ZeroMQ for activations of 4 KB, 1 MB and 64 MB.

    python -m benchmarks.transport [--repeat N]

Prints, per size: round trip over tcp loopback (encode -> PUSH -> PULL -> decode -> PUSH back -> PULL -> decode),
encode+decode throughput against a plain memory copy of the same bytes (torch clone), and one-way ZMQ throughput."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch
import zmq
import zmq.asyncio

from services.launch import free_port
from shared.protocol import ForwardBatch, SeqEntry, decode, encode
from shared.steps import Prefill

SIZES = {"4 KB": 4 << 10, "1 MB": 1 << 20, "64 MB": 64 << 20}


def make_batch(nbytes: int, dtype=torch.bfloat16, hidden_size: int = 1024) -> ForwardBatch:
    """One sequence's prefill chunk whose activation [tokens, hidden] is nbytes of bf16."""
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


async def round_trips(batch: ForwardBatch, repeat: int) -> list[float]:
    ctx = zmq.asyncio.Context()
    a_in, b_in = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pull_a, pull_b = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    pull_a.bind(a_in)
    pull_b.bind(b_in)
    push_to_b, push_to_a = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
    push_to_b.connect(b_in)
    push_to_a.connect(a_in)

    async def echo():
        while True:
            msg = decode(await pull_b.recv_multipart(copy=False))
            await push_to_a.send_multipart(encode(msg), copy=False)

    task = asyncio.create_task(echo())
    out = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        await push_to_b.send_multipart(encode(batch), copy=False)
        back = decode(await pull_a.recv_multipart(copy=False))
        out.append(time.perf_counter() - t0)
        assert torch.equal(back.hidden, batch.hidden)
    task.cancel()
    for s in (pull_a, pull_b, push_to_a, push_to_b):
        s.close(0)
    ctx.term()
    return out[1:]


async def one_way(batch: ForwardBatch, repeat: int) -> float:
    ctx = zmq.asyncio.Context()
    addr = f"tcp://127.0.0.1:{free_port()}"
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(addr)
    push.connect(addr)
    await push.send_multipart(encode(batch), copy=False)
    decode(await pull.recv_multipart(copy=False))
    t0 = time.perf_counter()
    for _ in range(repeat):
        await push.send_multipart(encode(batch), copy=False)
        decode(await pull.recv_multipart(copy=False))
    elapsed = time.perf_counter() - t0
    pull.close(0)
    push.close(0)
    ctx.term()
    return repeat * batch.hidden.nbytes / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    print(f"{'size':>6} | {'round trip (median)':>19} | {'codec GB/s':>10} | {'memcpy GB/s':>11} | {'codec/memcpy':>12} | "
          f"{'zmq one-way GB/s':>16} | {'zmq/memcpy':>10}")
    for label, nbytes in SIZES.items():
        batch = make_batch(nbytes)
        n = batch.hidden.nbytes
        reps = args.repeat if nbytes < (32 << 20) else max(3, args.repeat // 4)
        codec_s = best(lambda b=batch: decode(encode(b)), reps)
        copy_s = best(lambda b=batch: b.hidden.clone(), reps)
        rtt = statistics.median(asyncio.run(round_trips(batch, reps)))
        zmq_bps = asyncio.run(one_way(batch, reps))
        codec_gbs, copy_gbs = n / codec_s / 1e9, n / copy_s / 1e9
        print(f"{label:>6} | {rtt * 1e3:>16.3f} ms | {codec_gbs:>10.2f} | {copy_gbs:>11.2f} | {codec_gbs / copy_gbs:>12.2f} | "
              f"{zmq_bps / 1e9:>16.2f} | {zmq_bps / 1e9 / copy_gbs:>10.2f}")


if __name__ == "__main__":
    main()

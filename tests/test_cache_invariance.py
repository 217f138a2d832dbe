"""Cache hits under --batch-invariant, and the prefix-cache audit that checks them (issue 55 item 2), on real
processes over SmolLM2 float32.

A request that starts from a cached prefix must give the very logprobs of its prompt computed in full, whatever
came with it: prompts past a micro-batch's 512-token budget, a hit attached in the same micro-batch as its own
prompt's full prefill, another micro-batch in flight or none. Stages on one host take turns on its cores: a
micro-batch alone in the pipeline may compute on more threads (--threads-alone) than one beside others (--threads).
These meshes give the two counts different values, which is where batch-invariant numbers used to move: torch's
attention sums in another order on another thread count, so a prefix kept from a request computed alone differed
from its recompute beside others (the audit, at tolerance 0, reported 11 hits of 12 wrong).

- The mesh alone (start_mesh and a PipelineClient, micro-batches composed here): an attach and the same prompt's full
  prefill in one micro-batch, another in flight, against the prompt computed alone.
- Through a gateway (`stagemesh gateway --prefix-cache-audit 1` over the same mesh: the stages `up --batch-invariant
  --threads-alone ALONE` would start, not started twice): clients' hits on shared system texts against the same
  prompts computed uncached, and every hit audited."""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp
import pytest
import pytest_asyncio
import torch

from services.gateway.engine.prefix_cache import AUDIT_TOP, BLOCK_TOKENS
from services.process.launch import start_mesh
from services.testing.harness import start_gateway, wait_http
from shared.batch.sampling import SamplingParams
from shared.batch.steps import Prefill
from shared.wire.protocol import ForwardBatch, SeqEntry
from tests.conftest import starts_processes

SHARE = max(1, (os.cpu_count() or 1) // 2)  # each of 2 stages' threads beside other micro-batches (what `up` gives)
ALONE = SHARE + 1  # ... and alone in the pipeline: another count, always
INVARIANT = ["--batch-invariant", "--weights", "auto"]  # float32 activations on the fast kernels (not f32's)
SEED = random.randrange(1 << 16)  # the inputs differ from run to run; a failure names its seed
SAMPLING = SamplingParams(logprobs=True, top_logprobs=AUDIT_TOP)


def windows(rng: random.Random, ids: list, length: int) -> list:
    """A random window of `length` items of ids, read round and round."""
    start = rng.randrange(len(ids))
    return [ids[(start + i) % len(ids)] for i in range(length)]


# ---- the mesh alone: micro-batches composed exactly ------------------------------------------------------------

@pytest.fixture(scope="module")
@starts_processes
def mesh(tmp_path_factory):
    m = start_mesh("smollm2", 2, dtype="float32", threads=SHARE, threads_alone=ALONE, extra=INVARIANT,
                   log_dir=str(tmp_path_factory.mktemp("invariant-mesh")))
    yield m
    m.stop()


@pytest_asyncio.fixture
async def client(mesh):
    c = mesh.client()
    await c.start()
    yield c
    await c.close()


def chunks(seq_id: str, ids: list[int], size: int, start: int = 0, attach: str | None = None) -> list[SeqEntry]:
    """The prefill of ids[start:] in chunks of `size` (the first attaching the kept prefix `attach`)."""
    return [SeqEntry(seq_id, Prefill(min(size, len(ids) - a), a, len(ids), a + size >= len(ids),
                                     attach if a == start else None), SAMPLING)
            for a in range(start, len(ids), size)]


async def run(client, steps: list[list[SeqEntry]], prompts: dict[str, list[int]], beside: int = 0) -> dict:
    """Each list of steps as one micro-batch, in turn; with `beside` > 0 another micro-batch (a fresh prefill of that
    many tokens) is in flight with each, and both say so (in_flight 2) as the gateway does. The sample of each
    sequence whose prompt ended."""
    out, fillers = {}, []
    for k, entries in enumerate(steps):
        batch = ForwardBatch(client.next_mb_id(), entries, torch.tensor(
            [t for e in entries for t in prompts[e.seq_id][e.step.start_position:][:e.step.num_tokens]]),
            in_flight=2 if beside else 1)
        futures = [await client.submit(batch)]
        if beside:
            fillers.append(f"filler{k}")
            futures.append(await client.submit(ForwardBatch(
                client.next_mb_id(), [SeqEntry(fillers[-1], Prefill(beside, 0, beside, True))],
                torch.arange(1000, 1000 + beside), in_flight=2)))
        result = await asyncio.wait_for(futures[0], 120)
        await asyncio.wait_for(asyncio.gather(*futures[1:]), 120)
        out |= {s: samples[0] for s, samples in result.by_sequence().items()}
    await client.release(fillers)
    return out


async def test_a_hit_attached_beside_its_prompts_full_prefill_gives_the_very_logprobs(client, smollm2, varied_text):
    """A prompt of 600-1100 tokens computed alone, one chunk per micro-batch, is the reference. Then, with another
    micro-batch in flight each time, the same prompt is prefilled in full and attached to a kept prefix of it in the
    same micro-batches -- the attach's first chunk beside a full chunk, in either order, at chunk sizes the gateway
    may use: each gives the reference's first token, logprob and top alternatives, bit for bit."""
    rng = random.Random(SEED)
    text = smollm2.tokenizer.encode(varied_text)
    prompt = windows(rng, text, rng.randrange(600, 1100))
    shared = rng.randrange(300, len(prompt) - 100)  # the kept prefix's tokens of it
    attach_at = shared // BLOCK_TOKENS * BLOCK_TOKENS  # the gateway reuses whole blocks
    kept = prompt[:shared] + windows(rng, text, 7)  # a finished request that shares the prompt's first `shared` tokens
    prompts = {"reference": prompt, "kept": kept}
    reference = (await run(client, [[e] for e in chunks("reference", prompt, 128)], prompts))["reference"]
    await run(client, [[e] for e in chunks("kept", kept, 128)], prompts)
    await client.release(["reference"], keep=["kept"])
    for trial, (size, attach_first) in enumerate([(128, True), (128, False), (rng.randrange(40, 300), True)]):
        full, hit = f"full{trial}", f"hit{trial}"
        prompts |= {full: prompt, hit: prompt}
        a, b = chunks(hit, prompt, size, attach_at, attach="kept"), chunks(full, prompt, size)
        if not attach_first:
            a, b = b, a
        steps = [[e for e in pair if e is not None] for pair in
                 zip(a + [None] * (len(b) - len(a)), b + [None] * (len(a) - len(b)))]
        out = await run(client, steps, prompts, beside=rng.randrange(8, 64))
        await client.release([full, hit])
        where = f"(seed {SEED}, prompt {len(prompt)} tokens, attached at {attach_at}, chunks of {size})"
        assert out[full] == reference, f"the full prefill beside the attach differs from the prompt alone {where}"
        assert out[hit] == reference, f"the attached hit differs from the prompt computed alone {where}"
    await client.release(["kept"])


# ---- through a gateway: clients' hits, and the audit at tolerance 0 ---------------------------------------------

PROMPTS = 6  # the clients' prompts, each hitting one of two shared system texts (3 each): that many audits


async def complete(session: aiohttp.ClientSession, url: str, prompt: str, scope: str) -> dict:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "logprobs": AUDIT_TOP, "cache_salt": scope}
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def audits(gw) -> dict[str, float]:
    return {r: gw.metric("stagemesh_gateway_prefix_cache_audits_total", result=r)
            for r in ("match", "mismatch", "skipped")}


async def test_cached_answers_equal_uncached_ones_and_the_audit_finds_every_hit_right(mesh, varied_text, tmp_path):
    """Six prompts of 560-1030 tokens, each a shared system text of ~450 tokens and a question of its own: each
    computed alone in a cache scope of its own (uncached), then all at once in a scope where the system texts are
    cached, every hit audited (rate 1). Each cached answer's logprobs and top alternatives are the uncached one's, bit
    for bit, and every audit -- a twin from the cached prefix against one computed in full, at tolerance 0 -- finds
    them equal. The gateway is the test's own, over the module's mesh (the PipelineClient of the test before has
    closed: the mesh's result address is free)."""
    gw = start_gateway(mesh, str(tmp_path), "--prefix-cache-audit", "1")
    try:
        await asyncio.to_thread(wait_http, gw.url + "/ready", 120)
        await _cached_equal_uncached(gw, varied_text)
    finally:
        gw.stop()


async def _cached_equal_uncached(gw, varied_text: str) -> None:
    rng = random.Random(SEED)
    words = varied_text.split()
    systems = [" ".join(windows(rng, words, rng.randrange(230, 300))) for _ in range(2)]
    prompts = [f"{systems[i % 2]}\n\n{' '.join(windows(rng, words, rng.randrange(120, 330)))}" for i in range(PROMPTS)]
    scope = f"invariance-{SEED}-{time.monotonic_ns()}"  # none of another test's prefixes
    before = audits(gw)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as s:
        uncached = [await complete(s, gw.url, p, f"{scope}-alone-{i}") for i, p in enumerate(prompts)]
        for system in systems:  # kept: the system texts are cached in `scope`
            await complete(s, gw.url, f"{system}\n\nHello.", scope)
        cached = await asyncio.gather(*(complete(s, gw.url, p, scope) for p in prompts))
    for u, c in zip(uncached, cached):
        assert c["usage"]["prompt_tokens"] > 512 and u["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] >= 320, c["usage"]
    differ = [(i, c["usage"]["prompt_tokens"]) for i, (u, c) in enumerate(zip(uncached, cached))
              if c["choices"][0]["logprobs"] != u["choices"][0]["logprobs"]]
    deadline = time.monotonic() + 300  # the audits' twins end after the clients' answers: poll for their verdicts
    while sum(audits(gw)[r] - before[r] for r in before) < PROMPTS and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    after = audits(gw)
    verdicts = {r: after[r] - before[r] for r in before}
    # (prompt, its tokens) whose cached answer differs from its uncached one; the audits' verdicts (the log names any
    # mismatch's request)
    assert (differ, verdicts) == ([], {"match": PROMPTS, "mismatch": 0, "skipped": 0}), \
        f"seed {SEED}; the gateway's log: {gw.log_path}"

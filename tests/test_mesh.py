"""Real stage processes on loopback over SmolLM2 (float32): 1, 2 and 3 stages."""

import asyncio
import json

import pytest
import pytest_asyncio

from services.process.launch import start_mesh
from shared.batch.sampling import SamplingParams
from shared.batch.steps import Prefill
from shared.runtime.generation import SequenceState, run_group_on_mesh
from shared.wire.pipeline_client import PipelineError
from shared.wire.protocol import ForwardBatch, SeqEntry
from tests.conftest import stagemesh_runs, starts_processes
from tests.mesh import generate_group

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors:"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
@starts_processes
def reference(smollm2):
    """Greedy tokens from `stagemesh generate --dtype float32 --temperature 0` per prompt (one interpreter, in turn)."""
    runs = stagemesh_runs(*(["generate", "--prompt", p, "--max-tokens", str(MAX_TOKENS), "--dtype", "float32",
                             "--temperature", "0", "--json"] for p in PROMPTS))
    assert all(r["code"] == 0 for r in runs), [r["stderr"] for r in runs]
    return {p: json.loads(r["stdout"])["token_ids"] for p, r in zip(PROMPTS, runs)}


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}stages")
@starts_processes
def mesh(request, tmp_path_factory):
    m = start_mesh("smollm2", request.param, dtype="float32", log_dir=str(tmp_path_factory.mktemp("mesh")))
    yield m
    m.stop()


@pytest_asyncio.fixture
async def client(mesh):
    c = mesh.client()
    await c.start()
    yield c
    await c.close()


def prompt_ids(smollm2):
    return {f"p{i}": smollm2.tokenizer.encode(p) for i, p in enumerate(PROMPTS)}


async def test_greedy_one_sequence_at_a_time_equals_generate(smollm2, client, reference):
    for i, p in enumerate(PROMPTS):
        out = await generate_group(client, {f"s{i}": smollm2.tokenizer.encode(p)}, MAX_TOKENS)
        assert out[f"s{i}"] == reference[p]


async def test_several_sequences_in_one_microbatch(smollm2, client, reference):
    out = await generate_group(client, prompt_ids(smollm2), MAX_TOKENS)
    assert [out[f"p{i}"] for i in range(len(PROMPTS))] == [reference[p] for p in PROMPTS]


async def test_several_microbatches_in_flight(smollm2, client, reference, mesh):
    groups = [{sid: ids} for sid, ids in prompt_ids(smollm2).items()]
    said_in_flight = []  # what each micro-batch tells the stages: with others in flight they compute on their share
    forward = client.forward

    async def recording(batch):
        said_in_flight.append(batch.in_flight)
        return await forward(batch)

    client.forward = recording
    results = await asyncio.gather(*(generate_group(client, g, MAX_TOKENS) for g in groups))
    merged = {k: v for r in results for k, v in r.items()}
    assert [merged[f"p{i}"] for i in range(len(PROMPTS))] == [reference[p] for p in PROMPTS]
    assert min(said_in_flight) >= 1 and 1 < max(said_in_flight) <= len(groups)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0  # the releases travel the ring after the last token: poll, don't guess a delay
    while any(s.info().kv_slots_used for s in mesh.stages) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert all(s.info().kv_slots_used == 0 for s in mesh.stages)  # every slot released


async def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(smollm2, client):
    ids = prompt_ids(smollm2)
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1234)
    alone = await generate_group(client, {"seeded": ids["p0"]}, MAX_TOKENS, {"seeded": params})
    busy_prompts = {"seeded": ids["p0"], **{k: v for k, v in ids.items() if k != "p0"}}
    busy_params = {"seeded": params, "p1": SamplingParams(temperature=1.0, seed=9), "p2": SamplingParams(temperature=1.5)}
    busy = await generate_group(client, busy_prompts, MAX_TOKENS, busy_params)
    assert busy["seeded"] == alone["seeded"]
    other = await generate_group(client, {"seeded": ids["p0"]}, MAX_TOKENS,
                                 {"seeded": SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=4321)})
    assert other["seeded"] != alone["seeded"]  # the seed really matters


async def test_missing_input_is_a_clear_error_for_that_microbatch(mesh, smollm2, reference):
    """A non-first stage given no activation errors (never embeds locally); a first stage given no token ids too.
    The stage keeps serving afterwards."""
    target, expected = (1, "without its input activation") if len(mesh.stages) > 1 else (0, "needs token ids")
    c = mesh.client(enter_at=target)
    await c.start()
    try:
        batch = ForwardBatch(c.next_mb_id(), [SeqEntry("x", Prefill(3, 0, 3, True))], tokens=None, hidden=None)
        with pytest.raises(PipelineError, match=expected):
            await asyncio.wait_for(c.forward(batch), 30)
    finally:
        await c.close()
    c = mesh.client()
    await c.start()
    try:
        out = await generate_group(c, {"after": smollm2.tokenizer.encode(PROMPTS[0])}, MAX_TOKENS)
        assert out["after"] == reference[PROMPTS[0]]
    finally:
        await c.close()


async def test_release_acknowledgements_are_counted_not_kept(client):
    """Every release the last stage acknowledges used to pile up in a queue nobody read (a slow leak)."""
    import gc
    import tracemalloc

    ids = [f"never-started-{i:06d}-{'x' * 40}" for i in range(100)]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30  # warm up sockets and codecs before measuring: until a round trip is acknowledged
    while client.releases_acknowledged < len(ids) and loop.time() < deadline:  # (this fresh client's result port
        await client.release(ids)  # may still be reconnecting from the last test's: send again until one returns)
        for _ in range(100):
            if client.releases_acknowledged >= len(ids):
                break
            await asyncio.sleep(0.01)
    assert client.releases_acknowledged >= len(ids), "the warm-up releases were never acknowledged"
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for _ in range(300):
        await client.release(ids)
    deadline = loop.time() + 60
    while client.releases_acknowledged < 301 * len(ids) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    gc.collect()
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename") if s.size_diff > 0)
    tracemalloc.stop()
    assert client.releases_acknowledged >= 301 * len(ids)  # (late acks of earlier tests may add a few)
    assert grown < 1 << 20, f"the client kept {grown} bytes for 30,000 acknowledged releases"  # ~3 MB when queued


def drafts_from(answer: list[int], k: int = 4):
    """A drafter proposing the next k - 1 tokens of `answer`: right, then with its last one wrong, then all wrong, in
    turn."""
    proposals = []

    def propose(s: SequenceState) -> list[int]:
        n = len(s.output_ids)
        draft = answer[n:n + k - 1]
        if len(proposals) % 3 == 1 and draft:
            draft = [*draft[:-1], (draft[-1] + 1) % 1000]
        if len(proposals) % 3 == 2:
            draft = [(t + 7) % 1000 for t in draft]  # one token from this pass
        proposals.append(draft)
        return draft

    return propose


async def test_a_step_of_several_tokens_equals_as_many_single_steps(smollm2, client):
    """k positions of one sequence in one micro-batch through every stage: the newest token and k - 1 drafted ones,
    each position sampled. The drafts here come from the answer itself (one-token steps' tokens) with some made
    wrong: a draft stands only where it equals what was sampled before it, and the K/V of the positions after a
    wrong one is written over -- so the tokens are exactly those of one-token steps, greedy and seeded alike, in
    fewer passes."""
    ids = prompt_ids(smollm2)
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, seed=77)):
        for sid in ("p0", "p2"):
            one = SequenceState(f"one-{sid}", ids[sid], params, MAX_TOKENS)
            single_passes = await run_group_on_mesh(client, [one], prefill_chunk=64)
            answer = one.output_ids
            assert len(answer) == MAX_TOKENS
            drafted = SequenceState(f"k-{sid}", ids[sid], params, MAX_TOKENS)
            passes = await run_group_on_mesh(client, [drafted], prefill_chunk=64, propose=drafts_from(answer))
            assert drafted.output_ids == answer
            assert passes < single_passes  # some drafts stood: fewer passes than tokens

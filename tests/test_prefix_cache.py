"""The prefix cache: the gateway's index (services/gateway/engine/prefix_cache.py), the stages' kept slots
(shared/models/kv_cache.py) and the scheduler between them -- a hit computes only the rest of the prompt and gives the
tokens a full prefill gives; room, misses and a lost pipeline fall back to computing, never to other numbers.

The scheduler tests drive the real scheduler over test_scheduler's Harness (micro-batches computed for real on a
tiny GGUF, in this process); tests/test_openai_api.py checks the same through a running mesh and the openai SDK."""

from __future__ import annotations

import math

import pytest
import torch

from services.gateway.engine.audit import AUDIT_TOLERANCE_F32, AUDIT_TOLERANCE_ROUNDED, audit_tolerance
from services.gateway.engine.prefix_cache import BLOCK_TOKENS, AuditTolerance, PrefixAudit, PrefixIndex
from services.gateway.engine.request import Request
from services.testing.tiny_gguf import TinySpec, write_tiny_gguf
from shared.batch.sampling import SamplingParams
from shared.batch.steps import Prefill
from shared.errors import KVCacheFull, PrefixMiss, UnknownSequence
from shared.models import kv_pages
from shared.models.kv_cache import KVCache
from shared.runtime.generation import generate_tokens
from shared.wire.protocol import ForwardBatch, ReleaseSeqs, SeqEntry, decode, encode
from tests.stage_infos import make_info
from tests.test_scheduler import Harness


def prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 31 + 11 * i) % 250 + 1 for i in range(n)]


def new_seq(h: Harness, ids: list[int], max_tokens: int = 6) -> Request:
    return Request(seq_id=f"s{next(h.ids)}", prompt_ids=list(ids), params=SamplingParams(), max_tokens=max_tokens)


async def run(h: Harness, seq: Request) -> Request:
    h.engine.submit(seq)
    await h.step()
    await h.deliver_all()
    assert seq.finish_reason == "length"
    return seq


def first_step(h: Harness, seq: Request):
    return next(e.step for b in h.client.order for e in b.seqs if e.seq_id == seq.seq_id)


# ---- the index alone ---------------------------------------------------------------------------------------------

def test_the_longest_indexed_prefix_is_found_in_whole_blocks_and_leaves_a_token_to_compute():
    index = PrefixIndex("model-a")
    ids = prompt(1, 50)
    assert index.insert("a", ids) == (True, [])  # 3 full blocks (48 tokens) kept
    assert index.lookup(ids[:20] + [999] * 30).tokens == BLOCK_TOKENS  # the first block only
    assert index.lookup(ids).tokens == 48
    assert index.lookup(ids[:48]).tokens == 32  # the last token must be computed: its logits sample the next
    assert index.lookup([999] + ids) is None
    assert PrefixIndex("model-b").lookup(ids) is None  # another pipeline identity: other hashes


def test_a_longer_prefix_replaces_the_ones_it_contains_and_a_contained_one_is_not_kept():
    index = PrefixIndex()
    turn1, turn2 = prompt(2, 40), prompt(2, 40) + prompt(3, 30)
    assert index.insert("t1", turn1) == (True, [])
    assert index.insert("t2", turn2) == (True, ["t1"])  # t2 serves every lookup t1 would
    assert index.insert("again", turn1) == (False, [])  # t2 holds all of it already
    assert index.insert("pinned", prompt(2, 40) + prompt(3, 40), pinned={"t2"}) == (True, [])  # t2 is about to be used
    assert len(index) == 2 and index.insert("short", [1, 2, 3]) == (False, [])


def test_a_turn_that_holds_the_last_turns_prompt_puts_it_first_to_evict_even_with_another_reply():
    """A chat client sends back its own text for the assistant's reply (re-tokenized, edited, or scripted): the new
    turn holds the last turn's prompt but not its generated tail. The last turn's prefix then goes first in the
    eviction order (only its tail would be lost), ahead of other conversations' prefixes, which share only part of
    the new turn's prompt and keep their recency."""
    index = PrefixIndex()
    system = prompt(5, 64)  # 4 whole blocks
    other = system + prompt(6, 40) + prompt(7, 20)  # another user: the same system text, its own question
    assert index.insert("other", other, prompt_tokens=104) == (True, [])
    turn1 = system + prompt(8, 48)  # prompt 112 tokens = 7 blocks, then 20 generated
    assert index.insert("t1", turn1 + prompt(9, 20), prompt_tokens=len(turn1)) == (True, [])
    turn2 = turn1 + prompt(10, 50)  # the client's reply text, then its next message
    assert index.lookup(turn2).prefix.seq_id == "t1"  # turn 2 starts from turn 1's prefix: now the most recent
    assert index.insert("t2", turn2 + prompt(11, 20), prompt_tokens=len(turn2)) == (True, [])
    assert len(index) == 3 and index.evict() == "t1"  # though "other" was used longer ago
    assert index.lookup(other).tokens == 112  # the other user's prefix stays
    turn3 = turn2 + prompt(12, 50)
    assert index.insert("t3", turn3 + prompt(13, 5), prompt_tokens=len(turn3)) == (True, [])
    assert index.evict(pinned={"t2"}) == "other" and index.evict() == "t2"  # pinned: not given up
    assert index.insert("t4", turn3 + prompt(14, 30), prompt_tokens=len(turn3)) == (True, ["t3"])  # contained


def test_eviction_takes_the_least_recently_used_prefix_that_is_not_pinned():
    index = PrefixIndex()
    for name in "abc":
        index.insert(name, prompt(ord(name)))
    index.lookup(prompt(ord("a")))  # a is now the most recently used
    assert index.evict(pinned={"b"}) == "c"
    assert index.evict() == "b" and index.evict() == "a" and index.evict() is None
    assert index.stats.evicted == 3 and index.lookup(prompt(ord("a"))) is None


# ---- the stage's slots -------------------------------------------------------------------------------------------

def test_a_kept_slot_moves_up_is_copied_into_a_new_sequence_has_no_lease_and_gives_way_when_slots_run_out():
    kv = KVCache(num_layers=2, num_slots=3, max_seq_len=64, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    slot = kv.allocate("done")
    assert slot == 0
    written = []
    for t in (*kv.k, *kv.v):
        t[slot, :, :24] = torch.randn(t[slot, :, :24].shape)
        written.append(t[slot, :, :24].clone())
    kv.filled[slot] = 24
    assert kv.keep("done") and kv.untouched_since(float("inf")) == []  # a kept prefix has no lease
    assert (kv.used_slots, kv.kept_slots) == (0, 1)  # /info's used_slots: live sequences only
    new = kv.allocate("next")
    assert new == 0  # the prefix moved to the top slot: live sequences stay packed at the bottom
    kv.attach("next", "done", 20)
    for t, w in zip((*kv.k, *kv.v), written):
        assert torch.equal(t[new, :, :20], w[:, :20])
    with pytest.raises(PrefixMiss, match="not kept"):
        kv.attach("next", "never-kept", 8)
    kv.allocate("third")
    kv.allocate("fourth")  # no free slot: the kept prefix gives its slot up
    assert kv.evicted == 1 and "done" not in kv and kv.kept_slots == 0
    with pytest.raises(KVCacheFull):
        kv.allocate("fifth")  # live sequences are never given up


def fill(kv: KVCache, seq_id: str, n: int) -> int:
    """A live sequence that wrote n positions of K/V (random numbers)."""
    slot = kv.allocate(seq_id)
    for t in (*kv.k, *kv.v):
        t[slot, :, :n] = torch.randn(t[slot, :, :n].shape)
    kv.filled[slot] = n
    return slot


def test_a_step_continues_only_a_live_sequence_that_holds_every_position_before_it():
    """What a gateway re-adopting sequences in place relies on (Gateway.readopt): a stage answers unknown_sequence,
    which replays the sequence, rather than continue one it finished prefilling short of the step, or one that ended
    and is kept as a cached prefix (whose pages other sequences may share)."""
    kv = KVCache(num_layers=1, num_slots=3, max_seq_len=64, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    slot = fill(kv, "live", 20)
    assert kv.slot("live", 20) == slot and kv.slot("live", 0) == slot
    with pytest.raises(UnknownSequence, match="from position 21 .it holds 20 positions"):
        kv.slot("live", 21)
    fill(kv, "ended", 12)
    assert kv.keep("ended") and kv.is_kept("ended") and not kv.is_kept("live")
    with pytest.raises(UnknownSequence, match="kept as a cached prefix"):
        kv.slot("ended", 11)


def test_prefix_rows_keep_prefixes_while_every_live_slot_is_in_use():
    kv = KVCache(num_layers=1, num_slots=2, max_seq_len=32, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                 prefix_slots=2)
    for name in ("a", "b"):
        fill(kv, name, 16)
        assert kv.keep(name)
    assert kv.kept_slots == 2 and kv.kept_bytes == 2 * 16 * kv.position_bytes
    assert sorted(kv.allocate(s) for s in ("x", "y")) == [0, 1]  # both live slots, from the rows kept ones leave
    assert kv.evicted == 0 and "a" in kv and "b" in kv
    with pytest.raises(KVCacheFull, match="all 2 KV slots"):
        kv.allocate("z")  # a free row is left only when a kept prefix gives it up -- never for a third live one
    kv.release("x")
    assert kv.allocate("z") == 0 and kv.kept_slots == 2


def test_a_sequence_that_would_pass_the_live_bound_is_refused_while_running_ones_go_on():
    """live_bytes: a micro-batch that starts a sequence past the live sequences' K/V bound is refused (kv_full: the
    gateway waits and sends it again); one that only continues running sequences always runs. Kept prefixes count
    against their own bound, not this one."""
    from shared.batch.layout import BatchLayout
    from shared.batch.steps import Decode, Prefill

    kv = KVCache(num_layers=1, num_slots=3, max_seq_len=64, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                 prefix_slots=1)
    kv.live_bytes = 40 * kv.position_bytes

    def chunk(name: str, start: int, n: int, first: bool) -> BatchLayout:
        if first:
            kv.allocate(name)
        step = Prefill(n, start, start + n, True) if n > 1 else Decode(start)
        layout = BatchLayout.build([kv.slot(name)], [step], kv.max_seq_len, kv.device)
        kv.check_room(layout, starting=first)
        kv.wrote(layout)
        return layout

    chunk("kept", 0, 30, first=True)
    assert kv.keep("kept")  # its 30 positions are the prefixes' bound's, not the live ones'
    chunk("a", 0, 30, first=True)
    assert kv.live_resident_bytes == 30 * kv.position_bytes
    with pytest.raises(KVCacheFull, match="past the 0 MiB this stage's --memory-budget leaves them"):
        chunk("b", 0, 11, first=True)  # 30 + 11 > 40
    kv.release("b")
    for pos in range(30, 45):  # a running sequence grows past the bound: never refused
        chunk("a", pos, 1, first=False)
    assert kv.live_resident_bytes == 45 * kv.position_bytes
    kv.release("a")
    chunk("b", 0, 40, first=True)  # room again once a running one ended


def test_kept_prefixes_stay_under_their_memory_bound_least_recently_used_given_up_first():
    kv = KVCache(num_layers=1, num_slots=2, max_seq_len=64, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                 prefix_slots=4, prefix_bytes=1000)
    per = kv.position_bytes  # 32 bytes: K and V of 4 float32s
    fill(kv, "a", 10)
    fill(kv, "b", 10)
    assert kv.keep("a") and kv.keep("b") and kv.kept_bytes == 20 * per
    kv.allocate("probe")
    kv.attach("probe", "a", 8)  # "a" is now the more recently used
    kv.release("probe")
    fill(kv, "c", 20)  # 640 bytes: with both others 1280 > 1000, so the least recently used, "b", goes
    assert kv.keep("c") and "b" not in kv and "a" in kv and kv.evicted == 1 and kv.kept_bytes == 30 * per
    assert kv.keep("c") and kv.evicted == 1 and kv.kept_slots == 2  # kept again: nothing given up for itself
    fill(kv, "huge", 40)  # 1280 bytes alone: not kept, and nothing given up for it
    assert not kv.keep("huge") and "huge" not in kv and kv.kept_slots == 2 and kv.evicted == 1
    assert kv.used_slots == 0 and kv.resident_bytes == kv.kept_bytes


def rows(kv: KVCache, slot: int, n: int) -> list[torch.Tensor]:
    return [t[slot, :, :n].clone() for t in (*kv.k, *kv.v)]


def same(kv: KVCache, slot: int, expected: list[torch.Tensor]) -> bool:
    n = expected[0].shape[1]
    return all(torch.equal(t[slot, :, :n], e) for t, e in zip((*kv.k, *kv.v), expected))


def proportional_bytes() -> int:
    """This process's memory as the kernel counts it, a page mapped n times counting 1/n each time (Pss)."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024


def test_a_sequence_started_from_a_kept_prefix_shares_its_pages_and_takes_memory_only_for_the_rest():
    # head_dim 64 float32: 256 bytes a position, 16 positions to a 4 KiB page; 2 layers x K, V x 2 heads = 8 runs
    kv = KVCache(num_layers=2, num_slots=2, max_seq_len=1024, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                 prefix_slots=1)
    pages = kv._pages
    fill(kv, "a", 800)
    assert kv.keep("a")  # moved up into a row other rows can map
    prefix = kv._slot_of["a"]
    a = rows(kv, prefix, 800)
    copy_bytes = 790 * kv.position_bytes  # 1.6 MB
    before = proportional_bytes()
    b = kv.allocate("b")
    kv.attach("b", "a", 790)  # pages 0-48 (positions 0-783) shared, positions 784-789 copied into b's 50th page
    grown = proportional_bytes() - before
    assert same(kv, b, [x[:, :790] for x in a])
    assert grown < 0.1 * copy_bytes, grown  # a copy takes 1.6 MB; b's own page of each run ~32 KB
    assert kv.shared_bytes == 784 * kv.position_bytes and kv.resident_bytes == (800 + 6) * kv.position_bytes
    for t in (*kv.k, *kv.v):
        t[b, :, 790:820] = 1.0  # b's own positions
        t[b, :, 3] = -5.0  # a write into a shared page (never made by a sequence) copies the page, never the prefix's
    assert same(kv, prefix, a) and torch.equal(kv.k[0][b, :, 3], torch.full_like(kv.k[0][b, :, 3], -5.0))
    kv.release("b")
    kv.release("a")
    assert pages.borrowed == {} and pages.lent == {} and pages.published == set() and pages.maps_used == 0
    assert proportional_bytes() - before < 0.1 * copy_bytes and float(kv.k[0][prefix].abs().sum()) == 0.0


def test_giving_up_a_prefix_others_share_gives_each_of_them_its_own_copy_first():
    kv = KVCache(num_layers=1, num_slots=2, max_seq_len=64, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                 prefix_slots=2)
    pages = kv._pages
    fill(kv, "a", 40)
    kv.keep("a")
    b = kv.allocate("b")
    kv.attach("b", "a", 32)
    for t in (*kv.k, *kv.v):
        t[b, :, 32:50] = torch.randn(t[b, :, 32:50].shape)
    kv.filled[b] = 50
    b_rows = rows(kv, b, 50)
    assert kv.keep("b")  # moves to a higher row: its borrowed pages stay borrowed, its own are copied
    kept_b = kv._slot_of["b"]
    assert kept_b != b and same(kv, kept_b, b_rows) and pages.shared_positions(kept_b) == 32
    c = kv.allocate("c")
    kv.attach("c", "b", 48)  # pages 0-1 from a (b's are a's), page 2 from b
    assert pages.borrowed[c] == [(2, kv._slot_of["a"]), (3, kept_b)] and same(kv, c, [x[:, :48] for x in b_rows])
    kv.release("a")  # b and c read a's pages: each gets a copy before they are freed
    assert same(kv, kept_b, b_rows) and same(kv, c, [x[:, :48] for x in b_rows])
    assert pages.borrowed == {} and kv.shared_bytes == 0
    kv.release("b")
    assert same(kv, c, [x[:, :48] for x in b_rows])
    kv.release("c")
    assert pages.maps_used == 0 and pages.published == set()


@pytest.mark.parametrize("why", ["positions do not fill whole pages", "no room for more mappings"])
def test_where_pages_cannot_be_shared_a_sequence_copies_the_prefix(why):
    head_dim = 48 if why == "positions do not fill whole pages" else 64  # 192 bytes a position: 4096 / 192 is not whole
    kv = KVCache(num_layers=1, num_slots=1, max_seq_len=256, num_kv_heads=2, head_dim=head_dim, dtype=torch.float32,
                 prefix_slots=1)
    if why == "no room for more mappings":
        kv._pages.map_budget = 3  # a share of vm.max_map_count, here fewer than one row's runs take
    fill(kv, "a", 100)
    kv.keep("a")
    a = rows(kv, kv._slot_of["a"], 100)
    b = kv.allocate("b")
    kv.attach("b", "a", 96)
    assert same(kv, b, [x[:, :96] for x in a]) and kv.shared_bytes == 0
    assert kv.resident_bytes == (100 + 96) * kv.position_bytes


def test_the_caches_of_one_process_share_its_mapping_budget(monkeypatch):
    """Every KV cache of a process draws on one MapBudget (the kernel's vm.max_map_count is per process): past it a
    sequence copies the prefix, and a released borrower or a cache that is gone gives its mappings back."""
    import gc

    budget = kv_pages.MapBudget(limit=1000, in_use=0)
    budget.limit = 16  # one borrowing row of the caches below: 1 layer x K, V x 2 heads x 2 pieces = 8; two rows 16
    monkeypatch.setattr(kv_pages, "_process_maps", budget)

    def cache_with_prefix() -> KVCache:
        kv = KVCache(num_layers=1, num_slots=2, max_seq_len=256, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                     prefix_slots=1)
        fill(kv, "a", 100)
        kv.keep("a")
        return kv

    first, second = cache_with_prefix(), cache_with_prefix()
    first.allocate("b")
    first.attach("b", "a", 96)
    second.allocate("b")
    second.attach("b", "a", 96)
    assert first.shared_bytes == second.shared_bytes == 96 * first.position_bytes and budget.used == 16
    second.allocate("c")
    second.attach("c", "a", 96)  # the process's budget is spent: c copies
    assert second.shared_bytes == 96 * first.position_bytes and budget.used == 16
    first.release("b")
    assert budget.used == 8
    del first
    gc.collect()
    assert budget.used == 8  # first held no borrowed pages any more
    second.release("c")
    second.allocate("d")
    second.attach("d", "a", 96)  # room again
    assert second.shared_bytes == 2 * 96 * second.position_bytes and budget.used == 16
    del second
    gc.collect()
    assert budget.used == 0  # a cache that is gone gives its mappings back


def test_attach_and_keep_cross_the_wire():
    step = Prefill(8, 32, 40, True, attach="abc123")
    batch = decode(encode(ForwardBatch(1, [SeqEntry("s", step)], tokens=torch.arange(8))))
    assert batch.seqs[0].step == step and step.starts_sequence
    assert decode(encode(ReleaseSeqs(["x"], keep=["y", "z"]))) == ReleaseSeqs(["x"], False, ["y", "z"])
    with pytest.raises(ValueError, match="attaches a cached prefix but starts at position 0"):
        Prefill(8, 0, 8, True, attach="abc123")


# ---- the scheduler over a real pipeline in this process ------------------------------------------------------------

async def test_a_repeated_prompt_computes_only_its_rest_and_samples_the_tokens_a_full_prefill_gives(tiny_path):
    h = Harness(tiny_path, kv_slots=4)
    first = await run(h, new_seq(h, prompt(1)))
    assert h.client.kept == [first.seq_id]  # 40 prompt + 5 fed outputs: 2 full blocks kept on the stages
    again = await run(h, new_seq(h, prompt(1) + [7, 9]))
    step = first_step(h, again)
    assert (step.attach, step.start_position, step.num_tokens) == (first.seq_id, 32, 42 - 32)
    assert again.cached_tokens == 32
    expected = list(generate_tokens(Harness(tiny_path).client.local, prompt(1) + [7, 9], SamplingParams(), 6))
    assert again.output_ids == expected
    assert h.scheduler.prefix.stats.hits == 1 and h.scheduler.prefix.stats.lookups == 2


@pytest.fixture(scope="module")
def odd_heads_path(tmp_path_factory) -> str:
    """head_dim 24: 96 bytes a position of a run, which no 4 KiB page holds a whole number of."""
    return write_tiny_gguf(str(tmp_path_factory.mktemp("odd") / "odd.gguf"), TinySpec(arch="llama", hidden=96,
                                                                                       head_dim=24))


@pytest.mark.parametrize("model", ["pages of 64 positions", "positions across pages"])
async def test_requests_on_one_long_prompt_share_its_kv_pages_and_sample_what_a_full_prefill_gives(
        model, tiny_path, odd_heads_path):
    """The tiny model's K/V: 64 bytes a position of a run (a layer's K or V of one head), 64 positions a page. Two
    requests on one 150-token prompt, each with its own 20-token question: the second attaches 144 tokens, of which
    128 (two pages of each run) are the first's own pages, mapped, not copied -- and still are once both are kept.
    Where positions straddle pages (head_dim 24), it copies them, to the same tokens."""
    path = tiny_path if model == "pages of 64 positions" else odd_heads_path
    h = Harness(path, kv_slots=4)
    kv = h.client.local.pieces[0].kv
    long = prompt(2, 150)
    await run(h, new_seq(h, long + prompt(5, 20)))
    again = await run(h, new_seq(h, long + prompt(6, 20)))
    assert again.cached_tokens == 144 and kv.kept_slots == 2
    assert kv.shared_bytes == (128 * kv.position_bytes if path == tiny_path else 0)
    cold = Harness(path, kv_slots=4, prefix_cache=False)
    reference = await run(cold, new_seq(cold, long + prompt(6, 20)))
    assert again.output_ids == reference.output_ids


async def test_the_next_turn_of_a_conversation_reuses_the_last_answer_too(tiny_path):
    h = Harness(tiny_path, kv_slots=4)
    turn1 = await run(h, new_seq(h, prompt(4, 30), max_tokens=12))
    history = turn1.prompt_ids + turn1.output_ids  # the K/V of all but the last output token is on the stages
    turn2 = await run(h, new_seq(h, history + prompt(5, 9)))
    assert turn2.cached_tokens == 32 > len(turn1.prompt_ids)
    cold = Harness(tiny_path, kv_slots=4, prefix_cache=False)
    reference = await run(cold, new_seq(cold, history + prompt(5, 9)))
    assert turn2.output_ids == reference.output_ids and reference.cached_tokens == 0 and not cold.client.kept


async def test_kept_prefixes_give_their_slots_to_new_requests_least_recently_used_first(tiny_path):
    h = Harness(tiny_path, kv_slots=2)
    a = await run(h, new_seq(h, prompt(6)))
    b = await run(h, new_seq(h, prompt(7)))
    assert len(h.scheduler.prefix) == 2  # both slots hold a cached prefix, no request runs
    c = await run(h, new_seq(h, prompt(8)))  # admitted: the oldest prefix (a) is released for it
    assert [a.seq_id] in h.client.released and h.scheduler.prefix.stats.evicted == 1
    assert c.output_ids == list(generate_tokens(Harness(tiny_path).client.local, prompt(8), SamplingParams(), 6))
    b2 = await run(h, new_seq(h, prompt(7) + [5]))
    assert b2.cached_tokens == 32 and first_step(h, b2).attach == b.seq_id


async def test_with_prefix_rows_a_full_pipeline_runs_new_requests_and_keeps_its_prefixes(tiny_path):
    """Both slots busy with new requests: the cached prefixes stay in the stages' prefix rows (the gateway evicts
    none) and the next turn still starts from one. With the rows shared (prefix_slots 0), the same requests took
    both prefixes' rows."""
    for prefix_slots, evicted in ((2, 0), (0, 2)):
        h = Harness(tiny_path, kv_slots=2, prefix_slots=prefix_slots)
        a = await run(h, new_seq(h, prompt(14)))
        await run(h, new_seq(h, prompt(15)))
        busy = [new_seq(h, prompt(16 + i)) for i in range(2)]
        for seq in busy:
            h.engine.submit(seq)
        await h.step()
        assert set(h.scheduler.running) == {s.seq_id for s in busy}  # both admitted at once
        await h.deliver_all()
        assert h.scheduler.prefix.stats.evicted == evicted
        again = await run(h, new_seq(h, prompt(14) + [6]))
        assert again.cached_tokens == (32 if prefix_slots else 0)
        assert again.output_ids == list(generate_tokens(Harness(tiny_path).client.local, prompt(14) + [6],
                                                        SamplingParams(), 6))
        if prefix_slots:
            assert first_step(h, again).attach == a.seq_id and h.client.local.pieces[0].kv.evicted == 0


async def test_the_gateway_evicts_by_the_stages_prefix_memory_before_a_stage_has_to(tiny_path):
    """A bound that holds one 45-position prefix: keeping the second releases the first from the index and the
    stages alike, so no stage ever gives a prefix up behind the gateway's back (no prefix_miss)."""
    probe = Harness(tiny_path, kv_slots=1)
    per = probe.client.local.pieces[0].kv.position_bytes
    h = Harness(tiny_path, kv_slots=2, prefix_slots=2, prefix_memory=60 * per)
    assert h.scheduler.prefix_positions == 60 and h.scheduler.kv_rows == 4  # read from the stage's /info
    a = await run(h, new_seq(h, prompt(20)))  # 40 prompt + 5 fed outputs = 45 positions
    b = await run(h, new_seq(h, prompt(21)))
    assert [a.seq_id] in h.client.released and h.scheduler.prefix.stats.evicted == 1
    assert h.scheduler.prefix.held_positions == 45 and len(h.scheduler.prefix) == 1
    kv = h.client.local.pieces[0].kv
    assert kv.evicted == 0 and kv.kept_slots == 1 and b.seq_id in kv
    again = await run(h, new_seq(h, prompt(21) + [2]))
    assert again.cached_tokens == 32 and h.scheduler.prefix.stats.misses == 0


async def test_a_stage_that_lost_the_prefix_answers_a_miss_and_the_request_prefills_in_full(tiny_path):
    h = Harness(tiny_path, kv_slots=4)
    kept = await run(h, new_seq(h, prompt(9)))
    h.client.local.release(kept.seq_id)  # a stage gave it up (or restarted) without the gateway knowing
    seq = new_seq(h, prompt(9) + [3])
    h.engine.submit(seq)
    await h.step()
    mb, (batch, _) = next(iter(h.client.sent.items()))
    assert batch.seqs[0].step.attach == kept.seq_id
    with pytest.raises(PrefixMiss):  # what the stage does with it
        h.client.local.pieces[0].kv.attach(seq.seq_id, kept.seq_id, 32)
    h.client.fail(mb, PrefixMiss.code, "cached prefix 'x' is not kept on this stage")
    await h.step()
    assert {seq.seq_id, kept.seq_id} in [set(r) for r in h.client.released]  # the new slot, and the prefix everywhere
    retry = h.client.order[-1].seqs[0].step
    assert retry.attach is None and retry.start_position == 0  # from nothing: the index forgot that prefix
    await h.deliver_all()
    assert seq.output_ids == list(generate_tokens(Harness(tiny_path).client.local, prompt(9) + [3],
                                                  SamplingParams(), 6))
    assert h.scheduler.prefix.stats.misses == 1 and seq.cached_tokens == 0


async def test_a_lost_pipeline_forgets_every_prefix_and_releases_what_survivors_keep(tiny_path):
    h = Harness(tiny_path, kv_slots=4)
    kept = await run(h, new_seq(h, prompt(10)))
    h.pipeline.mark_lost("test: a stage restarted")
    await h.step()
    assert len(h.scheduler.prefix) == 0 and [kept.seq_id] in h.client.released
    seq = await run(h, new_seq(h, prompt(10) + [1]))
    assert seq.cached_tokens == 0 and first_step(h, seq).attach is None


# ---- the audit (--prefix-cache-audit) -------------------------------------------------------------------------------

async def audited_hit(h: Harness) -> tuple[Request, Request]:
    """A prompt run twice: the second starts from the first's cached prefix, and the audit (rate 1) checks that hit."""
    first = await run(h, new_seq(h, prompt(12)))
    again = new_seq(h, prompt(12) + [4, 8])
    h.engine.submit(again)
    await h.step()
    await h.deliver_all()
    return first, again


async def test_the_audit_recomputes_a_hit_and_finds_the_cache_right(tiny_path):
    """Rate 1: every hit gets two one-token twins, one from the cached prefix and one computed in full, whose top
    logprobs agree (float32 stages); the client's request is untouched, and the twins keep nothing."""
    h = Harness(tiny_path, kv_slots=6, prefix_cache_audit=1.0)
    first, again = await audited_hit(h)
    assert again.cached_tokens == 32 and again.finish_reason == "length"
    twins = [e for b in h.client.order for e in b.seqs if e.seq_id not in (first.seq_id, again.seq_id)]
    assert {e.step.attach for e in twins if e.step.starts_sequence} == {first.seq_id, None}  # cached, and in full
    stats = h.scheduler.prefix.stats
    assert (stats.audits, stats.audit_mismatches, stats.audit_skipped) == (1, 0, 0)
    assert not h.scheduler.running and not h.scheduler.waiting
    twin_ids = {e.seq_id for e in twins}
    assert len(twin_ids) == 2 and not twin_ids & set(h.client.kept)  # released, never kept as prefixes
    assert all(any(t in r for r in h.client.released) for t in twin_ids)
    assert again.output_ids == list(generate_tokens(Harness(tiny_path).client.local, prompt(12) + [4, 8],
                                                    SamplingParams(), 6))


async def test_the_audit_catches_a_cached_prefix_whose_kv_went_wrong(tiny_path, caplog):
    """A stage's kept K/V altered after it was kept (as a bug or a bit-flip would): the request cannot tell, the
    audit does -- a mismatch counted and logged, naming the request."""
    h = Harness(tiny_path, kv_slots=6, prefix_cache_audit=1.0)
    first = await run(h, new_seq(h, prompt(13)))
    kv = h.client.local.pieces[0].kv
    slot = kv._slot_of[first.seq_id]
    for t in kv.k:
        t[slot, :, 5:20] += 3.0
    again = new_seq(h, prompt(13) + [2])
    h.engine.submit(again)
    await h.step()
    await h.deliver_all()
    stats = h.scheduler.prefix.stats
    assert (stats.audits, stats.audit_mismatches) == (1, 1)
    assert any("disagree" in r.message and again.seq_id in r.message for r in caplog.records)


@pytest.mark.parametrize("stages,tolerance", [
    ([{"batch_invariant": True}, {"batch_invariant": True}], AuditTolerance(0.0)),
    ([{"weights_mode": "f32"}], AUDIT_TOLERANCE_F32),
    ([{"weights_mode": "f32"}, {"weights_mode": "auto"}], AUDIT_TOLERANCE_ROUNDED),  # one stage rounds: all may
    ([{"weights_mode": "auto"}], AUDIT_TOLERANCE_ROUNDED),  # the integer-dot kernels' 8-bit activations
    ([{"dtype": "bfloat16", "weights_mode": "f32"}], AUDIT_TOLERANCE_ROUNDED),
    ([{"batch_invariant": True, "weights_mode": "f32"}, {"weights_mode": "f32"}], AUDIT_TOLERANCE_F32),  # not all invariant
])
def test_the_audit_tolerance_follows_what_the_stages_promise(stages, tolerance):
    assert audit_tolerance([make_info(**s) for s in stages]) == tolerance


def audit_of(tolerance: AuditTolerance, cached: list[tuple[int, float]], full: list[tuple[int, float]]) -> PrefixAudit:
    audit = PrefixAudit("r", 32, tolerance, "c", "f")
    audit.results = {"c": (32, cached), "f": (0, full)}
    return audit


def test_rounded_stages_compare_probabilities_exact_ones_logprobs():
    """Rounded activations move an unlikely alternative's logprob far and its probability little: within the rounded
    tolerance; a likely token's probability moved as far is a mismatch. Batch-invariant stages: any bit is one."""
    full = [(5, -0.05), (9, -3.5), (2, -7.0)]
    tail_moved = [(5, -0.05), (9, -3.5), (2, -8.2)]  # p 0.0009 -> 0.0003
    top_moved = [(5, -0.3), (9, -1.5), (2, -7.0)]  # p 0.95 -> 0.74
    assert audit_of(AUDIT_TOLERANCE_ROUNDED, tail_moved, full).compare()[0]
    assert not audit_of(AUDIT_TOLERANCE_ROUNDED, top_moved, full).compare()[0]
    assert not audit_of(AUDIT_TOLERANCE_F32, tail_moved, full).compare()[0]
    nudged = [(5, -0.05), (9, -3.5), (2, math.nextafter(-7.0, 0))]
    assert audit_of(AUDIT_TOLERANCE_F32, nudged, full).compare()[0]
    agree, diff, how = audit_of(AuditTolerance(0.0), nudged, full).compare()
    assert not agree and 0 < diff < 1e-9 and "tolerance 0 of logprobs" in how


def test_the_audit_rate_is_a_share():
    import argparse

    from services.gateway.flags import register

    root = argparse.ArgumentParser()
    register(root.add_subparsers())

    def parse(rate: str):
        return root.parse_args(["gateway", "--model", "m", "--stages", "http://a:1", "--prefix-cache-audit", rate])

    assert parse("0.05").prefix_cache_audit == 0.05
    for bad in ("1.5", "-0.1", "often"):
        with pytest.raises(SystemExit):
            parse(bad)


def test_a_cache_whose_rows_span_more_than_the_hosts_memory_maps_and_takes_only_what_is_written():
    """A stage's cache spans every row at the whole context (a 3B model's 97 rows at ~74k positions: 30 GB a tensor on
    a 24 GB host) and only its written positions take memory: each tensor 1.5x this host's RAM here. The kernel's
    default heuristic overcommit refused such a mapping (ENOMEM at a stage's start) until it reserved no swap."""
    with open("/proc/meminfo") as f:
        ram = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    head_dim, rows_ = 128, 8  # 512 bytes a position in float32
    positions = -(-3 * ram // 2 // (rows_ * head_dim * 4) // 1024) * 1024
    kv = KVCache(num_layers=1, num_slots=rows_, max_seq_len=positions, num_kv_heads=1, head_dim=head_dim,
                 dtype=torch.float32)
    assert kv.k[0].numel() * 4 > ram
    before = proportional_bytes()
    fill(kv, "a", 600)
    s = kv._slot_of["a"]
    kv.k[0][s, 0, positions - 1] = 1.0  # the row's far end: one more page
    assert float(kv.k[0][s, 0, positions - 1, 0]) == 1.0
    assert proportional_bytes() - before < 64 * 2**20  # two rows' pages written, not gigabytes
    kv.release("a")

"""Drafts (services/gateway/engine/speculator.py) from the client's prediction, the request's own context and the shared
n-gram pool, verified through the pipeline: where they come from, how long they grow, when the load policy allows
them, and -- through real gateways -- that they change the speed of an answer, never its tokens."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

from services.gateway.engine.drafts import (
    MAX_DRAFT_TOKENS,
    MAX_PREDICTED_TOKENS,
    SKIP_STEPS,
    ContextIndex,
    DraftBudget,
    PredictionIndex,
)
from services.gateway.engine.request import Request
from services.gateway.engine.speculator import (
    COST_WINDOW,
    EXPLORE_EVERY,
    SOURCES,
    NgramPool,
    PassCosts,
    Speculator,
    worth_drafting,
)
from services.gateway.frontend.schemas import RequestError, parse_generation
from services.testing.tiny_gguf import TinySpec, write_tiny_gguf
from shared.batch.sampling import SamplingParams
from shared.batch.steps import Prefill
from shared.files.gguf_loader import GgufLoader
from shared.runtime.generation import SequenceState, drive, run_local
from shared.runtime.stage_runtime import LocalPipeline
from shared.wire.protocol import SeqEntry
from tests.conftest import lazy_import

openai = lazy_import("openai")

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def test_a_draft_is_what_the_prediction_says_follows_the_newest_tokens():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert PredictionIndex(prediction).draft([9, 2, 3], 4) == [4, 5, 6, 7]  # the longest suffix found: (2, 3)
    assert PredictionIndex(prediction).draft([3], 2) == [4, 5]
    assert PredictionIndex(prediction).draft([42], 3) == []  # the output left the prediction
    assert PredictionIndex(prediction).draft([8, 9], 3) == []  # the prediction's end: nothing follows
    repeated = [5, 1, 2, 6, 6, 6, 1, 2, 7]  # (1, 2) twice: the occurrence nearest the output's own place
    assert PredictionIndex(repeated).draft([0, 0, 0, 0, 0, 0, 1, 2], 1) == [7]
    assert PredictionIndex(repeated).draft([1, 2], 1) == [6]


def test_a_prediction_draft_rejoins_the_prediction_where_the_output_left_it():
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 14, 18, 19]
    index = PredictionIndex(prediction)
    output = [7, 7, 7, 10, 11]  # a preamble the prediction does not have, then its start
    assert index.draft(output, 2) == [12, 13]
    index.stepped(2, 1)  # 12 stood; the model wrote 20 where the prediction has 13
    output += [12, 20]
    assert index.draft(output, 2) == []  # neither (12, 20) nor 20 is in it
    index.stepped(0, 0)
    output.append(14)  # back on the prediction: the 14 after the change, not the later one nearer the output's length
    assert index.draft(output, 3) == [15, 16, 17]
    assert PredictionIndex(prediction).draft(output, 3) == [18, 19]  # (a fresh index: the one nearest len(output))
    assert index.draft(output, 3, shortest=2) == []  # (20, 14) is not in it


def test_a_predictions_draft_doubles_while_it_stands_and_never_pauses():
    budget = DraftBudget(predicted=True)
    sizes = []
    for _ in range(4):
        sizes.append(budget.next_size())
        budget.update(sizes[-1], sizes[-1])
    assert sizes == [6, 12, MAX_PREDICTED_TOKENS, MAX_PREDICTED_TOKENS]
    for _ in range(3):  # a change in the output: the next draft is what stood and one more, never none
        budget.update(budget.next_size(), 0)
        assert budget.next_size() == 1 and budget.skip == 0


def test_a_request_with_a_prediction_drafts_from_its_context_where_the_output_left_the_prediction():
    spec = Speculator("auto")
    prompt = [1, 2, 3, 30, 31, 32, 33, 34, 35]
    req = request(prompt, prediction_ids=[40, 41, 42, 43], output_ids=[5, 30, 31])  # the answer quotes the prompt
    assert spec.draft(req, 16, ngrams=False) == [32, 33, 34, 35, 5, 30] and req.drafts.source == "context"
    req.output_ids += [32, 33, 9]  # two stood
    spec.verified(req, decoded=True, drafted=6, stood=2)
    req.output_ids += [40, 41]  # the output comes to the prediction
    assert spec.draft(req, 16, ngrams=False) == [42, 43] and req.drafts.source == "prediction"
    req.output_ids += [42, 43]
    spec.verified(req, decoded=True, drafted=2, stood=1)
    # usage reports the prediction's own drafted tokens (OpenAI's accepted / rejected prediction tokens)
    assert (req.drafts.prediction_stood, req.drafts.prediction_rejected) == (1, 1)
    assert (spec.stats.accepted["context"], spec.stats.accepted["prediction"]) == (2, 1)
    opted_out = request(prompt, prediction_ids=[40, 41, 42, 43], output_ids=[5, 30, 31], speculation=False)
    assert spec.draft(opted_out, 16, ngrams=False) == []  # no n-grams for it: its prediction alone drafts


def test_a_prediction_request_drafts_from_whichever_source_came_lately():
    """With a prediction, its draft, its context's and the pool's are candidates; where they start otherwise, the
    source whose first tokens came more often for this request lately wins (learnt from every candidate once the
    step is back), the prediction on a tie: a prediction that the output keeps changing the same way (a rename)
    hands over to the context, and takes over again where it stands."""
    spec = Speculator("auto")
    req = request([1, 2, 3, 9, 9, 9], prediction_ids=[1, 2, 3, 4, 5, 6, 7, 8], output_ids=[1, 2, 3])
    assert spec.draft(req, 4, ngrams=True) == [4, 5, 6, 7] and req.drafts.source == "prediction"  # nothing learnt yet
    assert req.drafts.candidates == {"prediction": [4, 5, 6, 7], "context": [9, 9, 9, 1], "pool": []}
    req.output_ids += [9]  # the model wrote the context's 9, not the prediction's 4
    spec.verified(req, decoded=True, drafted=4, stood=0)
    assert req.drafts.first_hits == {"prediction": [0.0, 1.0], "context": [1.0, 0.0]} and not req.drafts.candidates
    assert req.drafts.first_hit_chance("context") == 2 / 3 > req.drafts.first_hit_chance("prediction") == 1 / 3
    req.output_ids, req.drafts.budget.size = [1, 2, 3], 4  # the same place again (and room for 4): the context's
    assert spec.draft(req, 4, ngrams=True) == [9, 9, 9, 1] and req.drafts.source == "context"
    req.output_ids += [4]  # ... but this time the output kept to the prediction
    spec.verified(req, decoded=True, drafted=4, stood=0)
    # the older counts fade (RECENT); the pool had learnt this request's own 1 2 3 9 and drafted 9 too
    assert req.drafts.first_hits == {"prediction": [1.0, 0.8], "context": [0.8, 1.0], "pool": [0.0, 1.0]}
    req.output_ids, req.drafts.budget.size = [1, 2, 3], 4
    assert spec.draft(req, 4, ngrams=True) == [4, 5, 6, 7] and req.drafts.source == "prediction"  # back to it
    # at a load that keeps n-grams off (ngrams=False), the pool is no candidate; the context still is
    assert set(spec.draft(req, 4, ngrams=False) and req.drafts.candidates) == {"prediction", "context"}


def test_the_draft_length_follows_how_the_last_drafts_fared():
    budget = DraftBudget()
    first = budget.next_size()
    budget.update(first, first)  # every drafted token stood: longer
    assert budget.next_size() == first + 2
    budget.update(8, 3)  # three stood: the next one drafts what stood and one more
    assert budget.next_size() == 4
    for _ in range(8):
        budget.update(budget.next_size(), 0)
        if budget.skip:
            break
    assert [budget.next_size() for _ in range(SKIP_STEPS)] == [0] * SKIP_STEPS and budget.next_size() == 1
    for _ in range(20):
        size = budget.next_size()
        budget.update(size, size)
    assert budget.next_size() == MAX_DRAFT_TOKENS


def test_the_context_drafts_what_followed_the_longest_recent_suffix():
    index = ContextIndex()
    ids = [5, 1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3]
    assert index.draft(ids, 2) == [9, 9]  # (1, 2, 3) before (2, 3): the longest suffix found wins
    ids += [4, 2, 3]  # the sequence grows: only the new tokens are indexed
    assert index.draft(ids, 3) == [4, 2, 3]  # (2, 3): its most recent earlier occurrence, with what followed it
    assert index.draft(ids + [6], 3) == []  # (3, 6) and (2, 3, 6) occur nowhere before
    assert ContextIndex().draft([256, 1, 0, 7, 1, 0], 2) == [7, 1]  # whole tokens only, never bytes across two


def test_the_pool_is_bounded_and_drafts_what_it_recorded():
    pool = NgramPool(n=3, bits=8)
    pool.add([10, 11, 12, 13, 14, 15], 0)
    assert pool.draft([99, 10, 11, 12], 5) == [13, 14, 15]  # each token what followed the 3 before it, chained
    assert pool.draft([10, 11, 12], 5, salt=1) == []  # another tenant's hashes: nothing of this one's
    pool.add([10, 11, 12, 20], 3)  # a later answer: the n-gram's newest follower replaces the old one
    assert pool.draft([10, 11, 12], 1) == [20]
    before = pool.used
    pool.add(list(range(1000, 6000)), 0)  # far more n-grams than entries
    assert len(pool.table) == len(pool) == 256 and before < pool.used <= 256  # constant memory
    assert pool.draft([5996, 5997, 5998], 1) == [5999]  # the newest n-gram is there (older ones may be overwritten)


def test_a_draft_is_as_long_as_pays_by_the_measured_cost_of_its_rows():
    costs = PassCosts()
    assert worth_drafting(6, 0.3, costs, 1) == 6  # nothing measured yet: try, and measure
    for rows, seconds in ((1, 0.5), (7, 0.9), (1, 0.010), (7, 0.013), (7, 0.030)):  # warm-up, a busy host: slower
        costs.observe(rows, seconds)
    assert costs.seconds == {1: 0.010, 7: 0.013}  # the fastest of each: rows nearly free here, 0.5 ms each
    assert worth_drafting(6, 0.9, costs, 1) == 6
    assert worth_drafting(6, 0.3, costs, 1) == 2  # a third drafted token would stand too rarely to pay its row
    for _ in range(COST_WINDOW):
        costs.observe(7, 0.040)  # only the latest passes count: the host (or the kernels) changed
    assert costs.seconds[7] == 0.040
    costs = PassCosts()
    for rows, seconds in ((1, 0.010), (2, 0.016), (7, 0.020)):  # a second row costs 6 ms, later ones 0.8 ms each
        costs.observe(rows, seconds)
    assert worth_drafting(6, 0.3, costs, 1) == 0  # 1.3 tokens for 1.6x the time: no draft beats none
    assert worth_drafting(6, 0.5, costs, 1) == 3  # 1.875 tokens for 1.76x
    assert worth_drafting(6, 0.95, costs, 1) == 6
    spec = Speculator("auto")  # where the costs refuse every draft, one in EXPLORE_EVERY still goes (and is timed)
    spec.costs = costs
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    first = request(prompt)
    assert len(spec.draft(first, 16, ngrams=True)) == 6  # a request's first draft goes whole: it measures its drafts
    missing = request(prompt)
    missing.drafts.missed = 10  # none of its drafts stood so far
    sizes = []
    for _ in range(2 * EXPLORE_EVERY):
        sizes.append(len(spec.draft(missing, 16, ngrams=True)))
        missing.drafts.budget = DraftBudget()  # (as if it had not missed: only the costs decide here)
    assert sizes.count(0) == 2 * EXPLORE_EVERY - 2 and sizes[EXPLORE_EVERY - 1] == sizes[-1] == 6
    forced = Speculator("on")  # --speculation on: whatever the costs
    forced.costs = costs
    assert len(forced.draft(missing, 16, ngrams=True)) == 6


def test_a_prediction_draft_is_sized_by_runs_not_by_tokens_alike():
    """A prediction's drafts stand in runs: its first drafted token's chance is counted by how many output tokens
    located the draft, the later tokens' apart. A request whose drafts stood whole where the output was on the text
    and missed at once where one token alike located them drafts long on the text and nothing off it, where its
    acceptance token by token alike would cut both to the same middling length."""
    assert worth_drafting(6, 0.5, PassCosts(), 1, first=0.1) == 6  # nothing measured: explore
    costs = PassCosts()
    for rows in range(1, 18):  # a base of 7 ms and 1.2 ms a row: SmolLM2's 2-stage pass
        costs.observe(rows, (7.0 + 1.2 * rows) / 1e3)
    assert worth_drafting(16, 0.95, costs, 1, first=0.1) == 0  # the first would rarely stand: no draft pays
    assert worth_drafting(16, 0.98, costs, 1, first=0.9) == 16
    assert worth_drafting(16, 0.5, costs, 1) == worth_drafting(16, 0.5, costs, 1, first=0.5) == 2
    text = list(range(100, 160))
    spec, req = Speculator("auto"), request([1, 2], prediction_ids=text)
    spec.costs = costs
    req.output_ids = text[:8]
    draft = spec.draft(req, 16, ngrams=False)
    assert draft == text[8:14] and req.drafts.located == 4  # the first draft goes whole; found by 4 tokens
    spec.verified(req, decoded=True, drafted=6, stood=6)
    for located, drafted, stood in [(4, 16, 16)] * 2 + [(1, 1, 0)] * 6:
        req.drafts.located, req.drafts.source = located, "prediction"
        spec.verified(req, decoded=True, drafted=drafted, stood=stood)
    assert req.drafts.first_chance(4) == 4 / 5 and req.drafts.first_chance(1) == 1 / 8
    assert req.drafts.later_chance == (5 + 15 + 15 + 1) / (35 + 2) and req.drafts.first_chance(2) == 1 / 2
    req.output_ids, req.drafts.budget.size = text[:20], 16
    req.drafts.prediction.expected = 20
    assert spec.draft(req, 16, ngrams=False) == text[20:36]  # on the text (4 tokens locate it): all 16
    req.output_ids = [*text[:20], 7, 7, 7, text[40]]  # left the text; one token of it alike
    req.drafts.prediction.expected = None
    assert spec.draft(req, 16, ngrams=False) == [] and req.drafts.located == 1
    token_by_token = worth_drafting(16, req.drafts.acceptance, costs, 1)  # 38 stood, 6 drafts missed
    assert 0 < token_by_token < 16


def request(prompt, **kw) -> Request:
    return Request(seq_id="r", prompt_ids=list(prompt), params=SamplingParams(temperature=0), **kw)


def test_what_drafts_and_when():
    """n-gram drafts: with --speculation auto, for a request that did not opt out, while the load allows; a
    prediction drafts either way; `rows` bounds every draft."""
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    auto, off = Speculator("auto"), Speculator("off")
    assert auto.draft(request(prompt), 16, ngrams=True) == [4, 5, 6, 7, 8, 1]  # DRAFT_TOKENS of the context
    assert auto.draft(request(prompt), 2, ngrams=True) == [4, 5]
    assert auto.draft(request(prompt), 16, ngrams=False) == []  # the load: too many sequences running
    assert len(Speculator("on").draft(request(prompt), 16, ngrams=False)) == 6  # on: at any load
    assert auto.draft(request(prompt, speculation=False), 16, ngrams=True) == []  # the request opted out
    assert off.draft(request(prompt), 16, ngrams=True) == [] and off.pool is None
    predicted = request(prompt, prediction_ids=[40, 41, 42], output_ids=[40])
    assert off.draft(predicted, 16, ngrams=False) == [41, 42] and predicted.drafts.source == "prediction"
    # an answer recorded in the pool drafts itself for a later request of the same tenant, not for another's
    first = request([50, 51], output_ids=list(range(60, 80)))
    auto.verified(first, decoded=True, drafted=0, stood=0)
    assert auto.draft(request([50, 51, *range(60, 68)]), 16, ngrams=True) == list(range(68, 74))
    assert auto.draft(request([50, 51, *range(60, 68)], cache_tenant="cache_salt:x"), 16, ngrams=True) == []


def test_what_stood_is_counted_and_sizes_the_next_draft():
    spec = Speculator("auto")
    req = request([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    draft = spec.draft(req, 16, ngrams=True)
    req.output_ids = [4, 5, 9]  # two of the draft stood
    spec.verified(req, decoded=True, drafted=len(draft), stood=2)
    assert req.drafts.budget.size == 3 and req.drafts.source is None
    assert req.drafts.acceptance == (2 + 1) / (2 + 1 + 2)  # two stood, one draft missed
    s = spec.stats
    assert (s.drafted["context"], s.accepted["context"], s.verify_steps["context"]) == (len(draft), 2, 1)
    assert sum(s.drafted[k] for k in SOURCES if k != "context") == 0
    assert (s.decode_steps, s.decode_tokens, s.tokens_per_pass) == (1, 3, 3.0) and s.hit_rate == 2 / len(draft)
    assert spec.pool.used == 3  # the pool took the n-grams its new tokens end


def test_status_shows_what_drafting_did():
    from rich.console import Console

    from services.cli.status import render

    spec = Speculator("auto")
    req = request([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    draft = spec.draft(req, 16, ngrams=True)
    req.output_ids = draft[:4]
    spec.verified(req, decoded=True, drafted=len(draft), stood=3)
    console = Console(record=True, width=80)
    console.print(render({"ready": True, "stages": [], "pipelines": [], "gateway": {"speculation": spec.info()}}, 80))
    text = console.export_text()
    assert "speculation auto: 3/6 drafted tokens stood (50%)" in text and "4.00 tokens a pass" in text, text
    assert max(len(line) for line in text.splitlines()) <= 80, text


@pytest.mark.parametrize("value", ["text", {"type": "content"}, {"type": "text", "content": "x"},
                                   {"type": "content", "content": [{"type": "image", "url": "x"}]},
                                   {"type": "content", "content": "x", "extra": 1}])
def test_a_malformed_prediction_is_a_400_naming_it(value):
    with pytest.raises(RequestError) as e:
        parse_generation({**CHAT, "prediction": value}, True, 8192, 49152)
    assert e.value.param == "prediction" and e.value.status == 400


@pytest.mark.parametrize("extra", [{"response_format": {"type": "json_object"}}, {"presence_penalty": 0.5},
                                   {"frequency_penalty": -0.5}, {"repetition_penalty": 1.2},
                                   {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                    "tool_choice": "required"}])
def test_a_prediction_with_a_constraint_or_a_penalty_is_a_400_naming_it(extra):
    """They need one position a step, so the prediction would draft nothing: refused, not silently ignored."""
    body = {**CHAT, "prediction": {"type": "content", "content": "abc"}, **extra}
    with pytest.raises(RequestError) as e:
        parse_generation(body, True, 8192, 49152)
    assert e.value.param == "prediction" and e.value.status == 400 and "does not go with" in e.value.message, e.value.message
    parse_generation({k: v for k, v in body.items() if k != "prediction"}, True, 8192, 49152)  # each alone is fine


def test_a_prediction_as_text_or_parts():
    assert parse_generation({**CHAT, "prediction": {"type": "content", "content": "abc"}}, True, 8192,
                            49152).prediction == "abc"
    parts = {"type": "content", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}
    assert parse_generation({**CHAT, "prediction": parts}, True, 8192, 49152).prediction == "abc"


TEXT = ("The river flows through the old town, past the mill and the church, and under the stone bridge where "
        "children fish on summer evenings. In winter the water freezes at the edges, and the ducks gather near the "
        "warm outlet of the bakery.")


REPEAT = [{"role": "system", "content": "Repeat the user's text word for word."}, {"role": "user", "content": TEXT}]


@pytest.fixture
def gateway(up):
    """--speculation on: n-gram drafts whatever this busy host's measured costs say (auto may rightly find that rows
    do not pay here, and draft little). Asked again by each test: the shared ups keep the recently asked ones."""
    return up("--speculation", "on", stages=2, dtype="float32")


def drafting(gw) -> dict[str, float]:
    """The gateway's drafting counters now: n-gram drafted and accepted tokens (context and pool), prediction ones,
    and every decode step of a sequence."""
    def total(name: str, sources: tuple[str, ...]) -> float:
        return sum(gw.metric(f"stagemesh_gateway_speculation_{name}_tokens_total", source=s) for s in sources)

    return {"drafted": total("drafted", ("context", "pool")), "accepted": total("accepted", ("context", "pool")),
            "predicted": total("drafted", ("prediction",)),
            "steps": gw.metric("stagemesh_gateway_speculation_decode_steps_total")}


def answer(gw, salt: str, speculation: bool = True, **kw) -> tuple[str, dict[str, float]]:
    """One chat completion of REPEAT (in a cache scope of its own: every answer prefills in full, as a cached
    prefix's remainder runs other kernels) and how the drafting counters moved during it."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    before = drafting(gw)
    out = client.chat.completions.create(model="smollm2", messages=REPEAT, max_tokens=60,
                                         extra_body={"cache_salt": salt, "speculation": speculation}, **kw)
    after = drafting(gw)
    return out.choices[0].message.content, {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("setup", ["float32", "batch-invariant"])
def test_ngram_drafts_change_how_fast_not_what(up, gateway, setup):
    """Greedy: the same answer with n-gram drafts as with the request's opt-out ("speculation": false), in fewer
    decode steps, where drafts of the text it repeats stood; the opted-out one drafted nothing."""
    gw = gateway if setup == "float32" else up("--batch-invariant", "--speculation", "on", dtype="float32")
    plain, off = answer(gw, f"off-{setup}", speculation=False, temperature=0)
    drafted, on = answer(gw, f"on-{setup}", temperature=0)
    assert drafted == plain
    assert off["drafted"] == 0 and off["steps"] > 0
    assert on["accepted"] > 0 and on["steps"] < off["steps"]
    deadline = time.monotonic() + 10
    while True:  # the mesh view (and `stagemesh status`): a snapshot a second, so one after that answer comes
        seen = json.loads(gw.get("/v1/mesh")[1])["gateway"]["speculation"]
        if seen["accepted"] >= on["accepted"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert seen["mode"] == "on" and seen["drafted"] >= seen["accepted"] >= on["accepted"]
    assert seen["tokens_per_pass"] > 1


def test_seeded_samples_are_the_same_with_drafts(gateway):
    """Temperature 0.7, one seed: each position's draw is seeded by its position, so a drafted token stands exactly
    where that draw gives it, and the answer is the one without drafts."""
    plain, off = answer(gateway, "sampled-off", speculation=False, temperature=0.7, seed=11)
    drafted, on = answer(gateway, "sampled-on", temperature=0.7, seed=11)
    assert drafted == plain and off["drafted"] == 0 and on["accepted"] > 0, (drafted, on, off)


def test_speculation_off_drafts_no_ngrams_but_a_prediction_still_drafts(up, gateway):
    """--speculation off: the same greedy answer as with n-gram drafts, none drafted; a client's prediction is its
    own request and still drafts."""
    expected, _ = answer(gateway, "expected", temperature=0)
    off = up("--speculation", "off", stages=2, dtype="float32")
    text, moved = answer(off, "off", temperature=0)
    assert text == expected and moved["drafted"] == 0 and moved["steps"] > 0
    _, predicted = answer(off, "predicted", temperature=0, prediction={"type": "content", "content": TEXT})
    assert predicted["predicted"] > 0 and predicted["drafted"] == 0


def test_a_prediction_changes_how_fast_not_what(gateway):
    """Greedy, with the text it should repeat as the prediction: the same answer, token for token, as without
    one; drafts that stood are reported as OpenAI reports them (completion_tokens_details)."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Repeat the user's text word for word."},
                {"role": "user", "content": TEXT}]
    def prediction_drafts() -> tuple[float, float]:  # the gateway's drafted and stood tokens of predictions so far
        return tuple(gateway.metric(f"stagemesh_gateway_speculation_{name}_tokens_total", source="prediction")
                     for name in ("drafted", "accepted"))

    # each in a cache scope of its own: both prefill in full (a cached prefix's remainder runs other kernels)
    plain = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                           extra_body={"cache_salt": "plain"})
    drafted_before, stood_before = prediction_drafts()
    predicted = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                               prediction={"type": "content", "content": TEXT},
                                               extra_body={"cache_salt": "predicted"})
    drafted, stood = (now - was for now, was in zip(prediction_drafts(), (drafted_before, stood_before)))
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    # the request alone on the gateway: its usage counts exactly what its drafts did (rejected: drafted, not stood)
    assert details.accepted_prediction_tokens == stood > 0, (details, drafted, stood)
    assert details.rejected_prediction_tokens == drafted - stood, (details, drafted, stood)
    assert plain.usage.completion_tokens_details is None or not plain.usage.completion_tokens_details.accepted_prediction_tokens
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                            stream=True, prediction={"type": "content", "content": TEXT},
                                            extra_body={"cache_salt": "streamed"})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.choices[0].message.content


def _chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """The chi-square goodness-of-fit p-value of counts against expected counts (len - 1 degrees of freedom)."""
    x = float(((observed - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2), torch.tensor(x / 2)))


@pytest.mark.slow  # sampling statistics: 1,536 sequences, ~25 s
def test_sampled_tokens_verified_in_a_drafted_pass_keep_the_models_distribution(tmp_path):
    """Temperature 3 over the top 8: 1,536 seeded sequences of 3 tokens on a tiny model, each drafting the greedy
    token after its first (drive, as the gateway's steps). Where the draft stood, the third token was sampled in the
    same pass as the second, from the drafted row; its rank among the model's top 8 at that prefix must follow the
    model's probabilities there (chi-square over the runs' summed expectations). The control: taking the draft
    itself as the second token (what a verifier that trusted drafts would emit) fails the same test."""
    temperature, k, groups, group = 3.0, 8, 24, 64
    pipe = LocalPipeline.load(GgufLoader(write_tiny_gguf(str(tmp_path / "tiny.gguf"), TinySpec(arch="llama"))), None,
                              torch.float32, kv_slots=group + 1, max_seq_len=64)
    names = itertools.count()

    def top(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's top k token ids after `tokens` and their probabilities as the sampler draws them."""
        sid = f"ref{next(names)}"
        logits = pipe.run([SeqEntry(sid, Prefill(len(tokens), 0, len(tokens), True), SamplingParams())],
                          torch.tensor(tokens))[-1]
        pipe.release(sid)
        best = logits.topk(k)
        return best.indices, torch.softmax(best.values / temperature, -1)

    prompt = [(7 * i + 3) % 200 + 1 for i in range(12)]
    first_draft: dict[str, int] = {}

    def propose(s: SequenceState) -> list[int]:
        draft = int(top(s.all_ids)[0][0])
        first_draft.setdefault(s.seq_id, draft)
        return [draft]

    observed, expected = torch.zeros(k), torch.zeros(k)
    control_observed, control_expected = torch.zeros(k), torch.zeros(k)
    for g in range(groups):
        states = [SequenceState(f"s{g}-{i}", list(prompt), SamplingParams(temperature=temperature, top_k=k,
                                                                          seed=1000 * g + i), 3) for i in range(group)]
        loop = drive(states, 64, propose)
        try:
            entries, tokens = next(loop)
            while True:
                entries, tokens = loop.send(run_local(pipe, entries, tokens))
        except StopIteration:
            pass
        for s in states:
            pipe.release(s.seq_id)
            t0, t1, t2 = s.output_ids
            ids, probs = top(prompt + [t0])
            control_observed[int((ids == first_draft[s.seq_id]).nonzero()[0])] += 1
            control_expected += probs
            if first_draft[s.seq_id] != t1:
                continue  # the draft fell: the third token came from a pass of its own
            ids, probs = top(prompt + [t0, t1])
            observed[int((ids == t2).nonzero()[0])] += 1
            expected += probs
    drafted = int(observed.sum())
    assert 0.5 * groups * group < drafted < groups * group  # most drafts stood, not all: both ways were taken
    assert _chi_square_p(observed, expected) > 1e-3, (observed, expected)
    assert _chi_square_p(control_observed, control_expected) < 1e-6, (control_observed, control_expected)

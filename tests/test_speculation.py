"""Drafts from the client's prediction (services/gateway/speculation.py), verified through the pipeline: where they
come from, how long they grow, and -- through a real gateway -- that they change the speed of an answer, never its
tokens."""

from __future__ import annotations

import openai
import pytest

from services.gateway.schemas import RequestError, parse_generation
from services.gateway.speculation import MAX_DRAFT_TOKENS, SKIP_STEPS, DraftBudget, predicted_draft

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


def test_a_draft_is_what_the_prediction_says_follows_the_newest_tokens():
    prediction = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert predicted_draft(prediction, [9, 2, 3], 4) == [4, 5, 6, 7]  # the longest suffix found: (2, 3)
    assert predicted_draft(prediction, [3], 2) == [4, 5]
    assert predicted_draft(prediction, [42], 3) == []  # the output left the prediction
    assert predicted_draft(prediction, [8, 9], 3) == []  # the prediction's end: nothing follows
    repeated = [5, 1, 2, 6, 6, 6, 1, 2, 7]  # (1, 2) twice: the occurrence nearest the output's own place
    assert predicted_draft(repeated, [0, 0, 0, 0, 0, 0, 1, 2], 1) == [7]
    assert predicted_draft(repeated, [1, 2], 1) == [6]


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


@pytest.mark.parametrize("value", ["text", {"type": "content"}, {"type": "text", "content": "x"},
                                   {"type": "content", "content": [{"type": "image", "url": "x"}]},
                                   {"type": "content", "content": "x", "extra": 1}])
def test_a_malformed_prediction_is_a_400_naming_it(value):
    with pytest.raises(RequestError) as e:
        parse_generation({**CHAT, "prediction": value}, True, 8192, 49152)
    assert e.value.param == "prediction" and e.value.status == 400


def test_a_prediction_as_text_or_parts():
    assert parse_generation({**CHAT, "prediction": {"type": "content", "content": "abc"}}, True, 8192,
                            49152).prediction == "abc"
    parts = {"type": "content", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}
    assert parse_generation({**CHAT, "prediction": parts}, True, 8192, 49152).prediction == "abc"


TEXT = ("The river flows through the old town, past the mill and the church, and under the stone bridge where "
        "children fish on summer evenings. In winter the water freezes at the edges, and the ducks gather near the "
        "warm outlet of the bakery.")


@pytest.fixture(scope="module")
def gateway(up):
    return up()


def test_a_prediction_changes_how_fast_not_what(gateway):
    """Greedy, with the text it should repeat as the prediction: the same answer, token for token, as without
    one; drafts that stood are reported as OpenAI reports them (completion_tokens_details)."""
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Repeat the user's text word for word."},
                {"role": "user", "content": TEXT}]
    # each in a cache scope of its own: both prefill in full (a cached prefix's remainder runs other kernels)
    plain = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                           extra_body={"cache_salt": "plain"})
    predicted = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                               prediction={"type": "content", "content": TEXT},
                                               extra_body={"cache_salt": "predicted"})
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    assert plain.usage.completion_tokens_details is None or not plain.usage.completion_tokens_details.accepted_prediction_tokens
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=60, temperature=0,
                                            stream=True, prediction={"type": "content", "content": TEXT},
                                            extra_body={"cache_salt": "streamed"})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.choices[0].message.content

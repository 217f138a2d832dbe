"""The one SSE module (services/gateway/api/sse.py): each event's bytes and the two cursor families' parsers, alone
(the streams themselves: tests/test_openai_api.py's resume after every chunk, tests/test_responses_api.py)."""

import pytest
from aiohttp.test_utils import make_mocked_request

from services.gateway.api import sse
from services.gateway.frontend.schemas import RequestError


def request(last_event_id: str | None = None, query: str = ""):
    headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
    return make_mocked_request("GET", "/v1/streams/x" + (f"?{query}" if query else ""), headers=headers)


def test_an_event_is_its_name_id_and_data_lines_then_a_blank_line():
    assert sse.frame({"a": 1}, event="e", id="ep:3") == b'event: e\nid: ep:3\ndata: {"a": 1}\n\n'
    assert sse.frame("[DONE]") == b"data: [DONE]\n\n"
    assert sse.frame({"b": 2}, id=0) == b'id: 0\ndata: {"b": 2}\n\n'


def test_a_chat_cursor_is_epoch_and_number_or_a_bare_number_and_the_header_wins():
    assert sse.chat_cursor(request(), "ep") == -1
    assert sse.chat_cursor(request("ep:7"), "ep") == 7
    assert sse.chat_cursor(request("7"), "ep") == 7
    assert sse.chat_cursor(request(query="starting_after=ep:2"), "ep") == 2
    assert sse.chat_cursor(request("ep:5", "starting_after=ep:2"), "ep") == 5  # what an EventSource last had
    with pytest.raises(RequestError) as e:
        sse.chat_cursor(request("other:7"), "ep")
    assert (e.value.status, e.value.code) == (410, "stream_expired")
    for bad in ("ep:x", "ep:-1", "ep:" + "9" * 10, "ep:", "ep:٣"):
        with pytest.raises(RequestError) as e:
            sse.chat_cursor(request(bad), "ep")
        assert (e.value.status, e.value.param) == (400, "Last-Event-ID"), bad


def test_a_sequence_cursor_is_a_number():
    assert sse.sequence_cursor(request()) == -1
    assert sse.sequence_cursor(request(query="starting_after=12")) == 12
    with pytest.raises(RequestError) as e:
        sse.sequence_cursor(request(query="starting_after=ep:1"))
    assert e.value.param == "starting_after"


def test_a_cursor_past_the_end_names_both_numbers():
    e = sse.past_the_end(9, 4, "starting_after")
    assert e.code == "cursor_out_of_range" and e.param == "starting_after" and "9" in e.message and "4" in e.message

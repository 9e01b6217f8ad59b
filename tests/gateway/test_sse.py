"""SSE framing (gateway.streams.sse): every event is one line for any line splitter, and its
JSON is the payload exactly."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.streams import sse

BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # what str.splitlines() breaks at


@given(st.text(alphabet=st.sampled_from(BREAKS) | st.characters()))
def test_an_event_is_one_line_for_splitlines_and_round_trips(text: str) -> None:
    event = sse({"choices": [{"delta": {"content": text}}]})
    # httpx's and requests' iter_lines() split as str.splitlines() does.
    lines = event.splitlines()
    assert event.endswith("\n\n") and lines == [event[:-2], ""]
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["delta"]["content"] == text


def test_the_characters_json_leaves_raw_are_escaped() -> None:
    event = sse({"t": "a\x85b\u2028c\u2029d"})
    assert event == 'data: {"t":"a\\u0085b\\u2028c\\u2029d"}\n\n'

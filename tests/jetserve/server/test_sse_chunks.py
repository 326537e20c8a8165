"""A stream's chunks built from its head serialized once are the bytes `_sse` writes."""

import json

import pytest

from jetserve.server.http_server import _sse, _sse_chunk, _sse_start

HEAD = {"id": "cmpl-0f3a", "object": "text_completion", "created": 1764700000,
        "model": "m \"quoted\" é"}
CHOICES = [
    {"index": 0, "text": "héllo\n\"x\"", "logprobs": None, "finish_reason": None},
    {"index": 3, "text": "", "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5],
                                          "top_logprobs": [{"a": -0.5}], "text_offset": [7]},
     "finish_reason": "stop"},
    {"index": 1, "delta": {"role": "assistant", "content": "\u2028"}, "logprobs": None,
     "finish_reason": None},
]


@pytest.mark.parametrize("usage", [{}, {"usage": {"prompt_tokens": 4, "completion_tokens": 2,
                                                  "total_tokens": 6}}])
@pytest.mark.parametrize("choice", CHOICES)
def test_chunk_equals_sse_of_the_merged_dict(choice, usage):
    got = _sse_chunk(_sse_start(HEAD), choice, usage)
    assert got == _sse({**HEAD, "choices": [choice], **usage})
    assert json.loads(got.removeprefix("data: "))["choices"] == [choice]

"""The gateway's answers (serving/openai/answer.py): the token chunks' template is JSON-equal to
the pydantic chunk, for every variant (escapes and markers in the text included)."""

from __future__ import annotations

import json

import pytest

from serving.openai.answer import Answer, Served
from serving.pb import common_pb2


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("return_ids", [False, True], ids=["text", "ids"])
def test_token_chunk_template_is_the_pydantic_chunk(chat, return_ids):
    a = Answer(chat, "cmpl-1", Served("m", "x"), return_ids)
    for usage_null in (False, True):
        for source in (0, common_pb2.ROLE_RELAY, common_pb2.ROLE_MAIN):
            for text, ids in (("abc", [12]), ("", [5, 6]), ("x", []),
                              ('q"\\\n\u00e9\u4e2d\x01 [987654321987] pddjax-text-marker', [1, 2])):
                want = a.chunk(text, ids, usage_null=usage_null, source=source).model_dump_json(exclude_unset=True)
                assert json.loads(a.token_chunk_json(text, ids, usage_null, source)) == json.loads(want)

"""The OpenAI response builders of the router (pure functions: no Ray, no HTTP)."""

import json

from services.engine.outputs import RequestOutput
from services.engine.sampling import TokenLogprobs
from services.router import protocol as p

VOCAB = {1: "He", 2: "llo", 3: " wé", 4: "!"}


def token_str(token: int) -> str:
    return VOCAB[token]


def out(token_ids, text, logprobs=None, finish_reason=None) -> RequestOutput:
    return RequestOutput("r-0", list(token_ids), logprobs or [None] * len(token_ids), text,
                         finished=finish_reason is not None, finish_reason=finish_reason)  # fmt: skip


def lp(logprob: float, *top: tuple[int, float]) -> TokenLogprobs:
    return TokenLogprobs(logprob, list(top))


OUTS = [
    out([1, 2], "Hello", [lp(-0.5, (1, -0.5), (4, -1.5)), lp(-0.25, (2, -0.25), (3, -2.0))]),
    out([3], " wé", [lp(-1.0, (3, -1.0), (4, -1.25))]),
    out([4], "!", [lp(-0.125, (4, -0.125), (1, -3.0))], finish_reason="length"),
]


def test_completion_choice_with_logprobs_and_text_offsets():
    choice = p.completion_choice(2, OUTS, [7, 8], token_str, logprobs=True)
    assert choice == {
        "index": 2,
        "text": "Hello wé!",
        "logprobs": {
            "tokens": ["He", "llo", " wé", "!"],
            "token_logprobs": [-0.5, -0.25, -1.0, -0.125],
            "top_logprobs": [
                {"He": -0.5, "!": -1.5},
                {"llo": -0.25, " wé": -2.0},
                {" wé": -1.0, "!": -1.25},
                {"!": -0.125, "He": -3.0},
            ],  # fmt: skip
            "text_offset": [0, 2, 5, 8],  # offsets in characters of the choice's text
        },
        "finish_reason": "length",
    }
    assert list(choice) == ["index", "text", "logprobs", "finish_reason"]  # OpenAI's key order
    assert p.completion_choice(0, OUTS, [7], token_str)["logprobs"] is None


def test_streamed_completion_chunks_continue_the_offsets():
    head = p.response_head("cmpl-1", "text_completion", "tiny", created=5)
    chunk = p.completion_chunk(head, 0, OUTS[1], token_str, offset=5, logprobs=True)
    assert {k: chunk[k] for k in head} == head
    assert chunk["choices"] == [{"index": 0, "text": " wé", "finish_reason": None,
                                 "logprobs": {"tokens": [" wé"], "token_logprobs": [-1.0],
                                              "top_logprobs": [{" wé": -1.0, "!": -1.25}], "text_offset": [5]}}]  # fmt: skip


def test_chat_choice():
    choice = p.chat_choice(1, OUTS, token_str, p.ChatParser(), logprobs=True)
    assert list(choice) == ["index", "message", "logprobs", "finish_reason"]
    assert choice["message"] == {"role": "assistant", "content": "Hello wé!"}
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["He", "llo", " wé", "!"]
    assert content[2] == {"token": " wé", "logprob": -1.0, "bytes": list(" wé".encode()),
                          "top_logprobs": [{"token": " wé", "logprob": -1.0, "bytes": [32, 119, 195, 169]},
                                           {"token": "!", "logprob": -1.25, "bytes": [33]}]}  # fmt: skip
    assert p.chat_choice(1, OUTS, token_str, p.ChatParser())["logprobs"] is None


def test_chat_logprobs_skip_tokens_without_logprobs():
    assert p.chat_logprobs([out([1, 2], "Hello")], token_str) == {"content": []}


def test_streamed_chat_chunk_with_held_back_text_has_empty_content():
    head = p.response_head("chatcmpl-1", "chat.completion.chunk", "tiny", created=5)
    held = out([3], "")  # a token ending mid UTF-8 character: its text is held back
    chunk = p.chat_chunk(head, 0, held, token_str, p.ChatParser())
    assert chunk == {**head, "choices": [{"index": 0, "delta": {"content": ""}, "logprobs": None,
                                          "finish_reason": None}]}  # fmt: skip
    assert p.chat_chunk(head, 0, OUTS[2], token_str, p.ChatParser())["choices"][0]["delta"] == {
        "content": "!"
    }
    assert p.chat_role_chunk(head, 3)["choices"] == [
        {"index": 3, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]


def test_usage_counts_each_prompt_once_whatever_n_is():
    prompts = [[1, 2, 3], [4, 5]]
    n = 3
    choices = [
        (i, prompts[i]) for i in range(len(prompts)) for _ in range(n)
    ]  # (prompt index, ids) per choice
    outs = [[out([1, 2], "Hello"), out([4], "!", finish_reason="stop")] for _ in choices]
    assert p.prompt_tokens(choices) == 5
    assert p.completion_tokens(outs) == 3 * len(choices)
    assert p.usage(p.prompt_tokens(choices), p.completion_tokens(outs), 2) == {
        "prompt_tokens": 5, "completion_tokens": 18, "total_tokens": 23, "prompt_tokens_details": {"cached_tokens": 2}
    }  # fmt: skip
    head = p.response_head("cmpl-1", "text_completion", "tiny", created=5)
    usage = p.usage(5, 18)
    assert p.response(head, [], usage) == {**head, "choices": [], "usage": usage}
    assert p.usage_chunk(head, usage) == {**head, "choices": [], "usage": usage}


def test_token_id_mode_adds_token_ids():
    choice = p.completion_choice(0, OUTS, [7, 8], token_str, token_ids=True)
    assert choice["token_ids"] == [1, 2, 3, 4] and choice["prompt_token_ids"] == [7, 8]
    assert list(choice)[-2:] == ["token_ids", "prompt_token_ids"]
    chat = p.chat_choice(0, OUTS, token_str, p.ChatParser(), token_ids=True)
    assert chat["token_ids"] == [1, 2, 3, 4] and "prompt_token_ids" not in chat
    head = p.response_head("x", "text_completion", "tiny", created=5)
    assert p.completion_chunk(head, 0, OUTS[0], token_str, token_ids=True)["choices"][0]["token_ids"] == [
        1,
        2,
    ]
    assert p.chat_chunk(head, 0, OUTS[1], token_str, p.ChatParser(), token_ids=True)["choices"][0][
        "token_ids"
    ] == [3]
    for without in (
        p.completion_choice(0, OUTS, [7], token_str),
        p.chat_choice(0, OUTS, token_str, p.ChatParser()),
    ):
        assert "token_ids" not in without and "prompt_token_ids" not in without


def test_sse_and_head():
    head = p.response_head("cmpl-1", "text_completion", "tiny", created=5)
    assert list(head) == ["id", "object", "created", "model"]
    assert isinstance(p.response_head("x", "chat.completion", "tiny")["created"], int)
    event = p.sse({**head, "choices": []})
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[6:]) == {**head, "choices": []}

"""`agentrl serve`'s chat completions, driven by the real `openai` SDK: tools, tool calls, token ids, auth."""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
from cli import agentrl, serving
from transformers import AutoTokenizer

from agentrl.engine.protocol import ChatMessage
from agentrl.env.tools import ToolCall
from agentrl.models.default import resolve_path
from agentrl.models.tokenizer import load_tokenizer, token_bytes
from agentrl.rollout import ChatFormat
from agentrl.rollout.chat_api import Reply, ReplyBook, reply_key

KEY = "test-key-123"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_python",
            "description": "Run Python code and see its output.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the solution.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
]
OPENING = [
    {"role": "system", "content": "Solve the task with Python. Test with run_python, then submit."},
    {"role": "user", "content": "Write compute(n: int) -> int that returns n doubled."},
]
GREEDY = {"temperature": 0, "max_tokens": 120, "extra_body": {"return_token_ids": True}}


@pytest.fixture(scope="module")
def url():
    with serving("--model", "default", "--api-key", KEY) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(AutoTokenizer.from_pretrained(resolve_path("default")))


def ids(reply) -> tuple[list[int], list[int]]:
    """The prompt and completion token ids of a reply (vLLM's return_token_ids fields)."""
    return reply.model_extra["prompt_token_ids"], reply.choices[0].model_extra["token_ids"]


def test_tool_calls_come_back_parsed_and_a_conversation_stays_token_exact(client, chat):
    first = client.chat.completions.create(model="default", messages=OPENING, tools=TOOLS, logprobs=True, **GREEDY)
    prompt, out = ids(first)
    assert prompt == chat.prompt_ids(OPENING, tools=TOOLS)  # the model's own template, as a rollout renders it
    message = first.choices[0].message
    assert message.tool_calls, f"the default policy calls a tool here: {message}"
    assert first.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    assert call.function.name in ("run_python", "submit") and "code" in json.loads(call.function.arguments)
    assert chat.decode(out).count("<tool_call>") == len(message.tool_calls)
    assert len(first.choices[0].logprobs.content) == len(out) and all(
        t.logprob <= 0 for t in first.choices[0].logprobs.content
    )
    assert first.usage.prompt_tokens == len(prompt) and first.usage.completion_tokens == len(out)
    assert first.choices[0].model_extra["policy_versions"] == [0] * len(out)

    # The SDK's message object goes back as it came (the way agents append it); the tool's result follows.
    results = [{"role": "tool", "tool_call_id": c.id, "content": "6"} for c in message.tool_calls]
    history = [*OPENING, message, *results]
    second = client.chat.completions.create(model="default", messages=history, tools=TOOLS, **GREEDY)
    prompt2, _ = ids(second)
    # the reply's own tokens, never re-rendered, then the template's delta for the tool messages
    delta = chat.observation_ids([{"role": "tool", "content": "6"}] * len(results), last_token=out[-1])
    assert prompt2 == prompt + out + delta

    # the same history written by hand (ids dropped, arguments re-serialised): found by content
    by_hand = {
        "role": "assistant",
        "content": message.content,
        "tool_calls": [
            {
                "id": f"other-{i}",
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": json.dumps(json.loads(c.function.arguments), indent=2),
                },
            }
            for i, c in enumerate(message.tool_calls)
        ],
    }
    again = [*OPENING, by_hand, *({**r, "tool_call_id": f"other-{i}"} for i, r in enumerate(results))]
    assert ids(client.chat.completions.create(model="default", messages=again, tools=TOOLS, **GREEDY))[0] == prompt2


def test_a_history_the_server_did_not_write_is_rendered_by_the_template(client, chat):
    forged = {
        "role": "assistant",
        "content": "I will run it.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run_python", "arguments": '{"code": "print(1)"}'}}
        ],
    }
    history = [*OPENING, forged, {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    prompt, _ = ids(client.chat.completions.create(model="default", messages=history, tools=TOOLS, **GREEDY))
    folded = 'I will run it.\n<tool_call>\n{"name": "run_python", "arguments": {"code": "print(1)"}}\n</tool_call>'
    plain = [*OPENING, {"role": "assistant", "content": folded}, {"role": "tool", "content": "1"}]
    assert prompt == chat.prompt_ids(plain, tools=TOOLS)


def test_a_stream_carries_the_same_reply(client):
    whole = client.chat.completions.create(model="default", messages=OPENING, tools=TOOLS, **GREEDY)
    stream = client.chat.completions.create(
        model="default", messages=OPENING, tools=TOOLS, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    content, calls, finish, usage, token_ids = "", {}, None, None, []
    chunks = list(stream)
    # OpenAI's shape, which clients rely on: the usage comes last, in a chunk without choices, and in no other
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert all(c.usage is None and c.choices for c in chunks[:-1])
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            token_ids += (choice.model_extra or {}).get("token_ids") or []
            for c in choice.delta.tool_calls or []:
                calls.setdefault(c.index, [c.function.name, ""])[1] += c.function.arguments or ""
            finish = choice.finish_reason or finish
    message = whole.choices[0].message
    assert (content or None) == message.content
    assert [[c.function.name, c.function.arguments] for c in message.tool_calls or []] == list(calls.values())
    assert finish == whole.choices[0].finish_reason and usage.completion_tokens == whole.usage.completion_tokens
    assert token_ids == ids(whole)[1]


@pytest.mark.parametrize(
    ("change", "status", "says"),
    [
        ({"model": "gpt-4o"}, 404, "model 'gpt-4o' is not served here"),
        ({"messages": [{"role": "tool", "tool_call_id": "x", "content": "1"}]}, 400, "a chat opens with"),
        ({"messages": [*OPENING, {"role": "tool", "tool_call_id": "nope", "content": "1"}]}, 400, "did not make"),
        ({"messages": [{"role": "user", "content": "x" * 10_000_000}]}, 400, "more than a context"),
        ({"messages": [*OPENING, {"role": "assistant", "content": "hi"}]}, 400, "the last message is the assistant"),
        ({"n": 2}, 400, "n=2 is not supported"),
        ({"tool_choice": "required"}, 400, "tool_choice='required' is not supported"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "'wizard' is not one of"),
        ({"temperature": -1}, 400, "temperature"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            400,
            "text only",
        ),
    ],
)
def test_bad_requests_get_an_openai_error_naming_the_problem(url, change, status, says):
    body = {"model": "default", "messages": OPENING, "max_tokens": 4} | change
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status, r.text
    assert says in r.json()["error"]["message"]


CALL = {
    "role": "assistant",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run_python", "arguments": "{}"}}],
}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": [{"role": "user", "content": "cut \ud83d in two"}]}, "messages.0"),
        ({"messages": [*OPENING, CALL, {"role": "tool", "tool_call_id": "c1", "content": "\udcff"}]}, "messages.3"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "\udfff"}}]}, "tools"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where(url, change, param):
    """JSON may escape half of a UTF-16 pair (`"\\ud83d"`): JavaScript's JSON.stringify of a string sliced inside an
    emoji sends one, as does Python's json.dumps of bytes decoded with surrogateescape. No tokenizer takes it."""
    body = {"messages": OPENING, "max_tokens": 4} | change
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    r = httpx.post(f"{url}/v1/chat/completions", content=json.dumps(body), headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "surrogate" in r.json()["error"]["message"]


def test_invalid_json_is_a_400(url):
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=b'{"messages": [',
        headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] is None  # no field to name (FastAPI's loc is the fault's byte offset)


def test_every_endpoint_but_health_needs_the_key(url, client):
    assert httpx.get(f"{url}/health").status_code == 200
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in [
            ("GET", "/v1/models"),
            ("POST", "/agentrl/weights"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/agentrl/version"),
        ]:
            r = httpx.request(method, f"{url}{path}", headers=headers, content=b"x")
            assert r.status_code == 401, (method, path, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list()] == ["default"]


def test_serve_refuses_to_listen_off_loopback_without_a_key():
    r = agentrl("serve", "--model", "default", "--host", "0.0.0.0", check=False, extra_env={"AGENTRL_API_KEY": ""})
    assert r.returncode != 0 and "give a key" in r.stderr


async def test_the_openai_engine_sends_the_key_its_setting_names(url, monkeypatch):
    from agentrl.engine import EngineConfig, EngineModel, SamplingParams, build_engine
    from agentrl.engine.openai import RequestRejected

    cfg = EngineConfig(kind="openai", base_url=url, api_key_env="SERVE_KEY")
    with pytest.raises(ValueError, match="SERVE_KEY, which is not set"):
        build_engine(cfg, EngineModel())
    monkeypatch.setenv("SERVE_KEY", KEY)
    async with build_engine(cfg, EngineModel()) as engine:
        gen = await engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    assert len(gen.token_ids) == 3
    monkeypatch.setenv("SERVE_KEY", "wrong")
    with pytest.raises(RequestRejected, match="401"):
        async with build_engine(cfg, EngineModel()) as engine:
            await engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3))


def test_the_reply_book_forgets_what_it_holds_no_more():
    """A reply said again (greedy decoding) replaces the one before it, by content and by its calls' ids: a reply
    past the book's capacity is found by nothing, and the book holds at most `capacity` replies."""
    book = ReplyBook(capacity=1)
    key = reply_key("run it", [ToolCall(name="run_python", arguments={})])
    for i in range(3):
        book.add(Reply([i], key, (f"call_{i}",)))
    calls = [{"id": "call_0", "type": "function", "function": {"name": "run_python", "arguments": "{}"}}]
    said = ChatMessage(role="assistant", content="run it", tool_calls=calls)
    assert book.find(said).ids == [2]  # the same words: the newest reply's tokens
    book.add(Reply([9], reply_key("other", []), ()))
    assert book.find(said) is None
    assert book.find(ChatMessage(role="assistant", content="other")).ids == [9]


def test_token_bytes_join_into_what_the_tokenizer_decodes():
    """Every token of the vocabulary (added ones with characters outside the byte table too: a space, a character the
    table maps to another byte), and sequences of them that split characters: the tokens' bytes joined are the text
    the tokenizer decodes, before it writes a byte that is no UTF-8 as U+FFFD."""
    tok = load_tokenizer()
    tok.add_tokens(["a b", "é!"])
    everyone = list(range(len(tok)))
    for t, b in zip(everyone, token_bytes(tok, everyone), strict=True):
        assert b.decode("utf-8", "replace") == tok.decode([t], skip_special_tokens=False), t
    rng = random.Random(0)
    for _ in range(500):
        ids = rng.choices(everyone, k=rng.randrange(1, 20))
        assert b"".join(token_bytes(tok, ids)).decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=False)
    assert token_bytes(tok, tok.encode("é", add_special_tokens=False)) == [b"\xc3", b"\xa9"]

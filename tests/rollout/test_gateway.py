"""The session gateway: SDK-written agents, each episode its own base URL and key, recorded token-exactly."""

from __future__ import annotations

import asyncio
import itertools
import json
import zlib

import httpx
import openai
import pytest
import torch
from test_chat_serve import OPENING, TOOLS
from transformers import AutoTokenizer

from agentrl.engine import EngineConfig, EngineModel, SamplingParams, build_engine
from agentrl.engine.protocol import ChatMessage
from agentrl.models.default import resolve_path
from agentrl.models.tiny import tiny_model
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat, Segment, Trajectory
from agentrl.rollout.gateway import Gateway

SAMPLING = SamplingParams(temperature=1.0, max_tokens=40)


@pytest.fixture(scope="module")
async def engine():
    path = resolve_path("default")
    async with build_engine(EngineConfig(), EngineModel(path)) as e:
        yield e


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(AutoTokenizer.from_pretrained(resolve_path("default")))


@pytest.fixture
async def gateway(engine, chat):
    async with Gateway(engine, chat, sampling=SAMPLING, max_episode_tokens=2048) as g:
        yield g


def new_trajectory(i: int = 0) -> Trajectory:
    return Trajectory(episode_id=f"e{i}", group_id="g", task_id="t", sampling=SAMPLING)


def client(access) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=access.base_url, api_key=access.api_key, max_retries=0)


async def sdk_agent(access, turns: int = 3) -> list:
    """A plain SDK agent: each reply goes back as the SDK returned it, each call answered with a tool message."""
    replies, messages = [], list(OPENING)
    async with client(access) as c:
        for t in range(turns):
            r = await c.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, logprobs=True, extra_body={"return_token_ids": True}
            )
            replies.append(r)
            message = r.choices[0].message
            messages.append(message)
            if message.tool_calls:
                messages += [{"role": "tool", "tool_call_id": c.id, "content": f"out {t}"} for c in message.tool_calls]
            else:
                messages.append({"role": "user", "content": "Use a tool."})
    return replies


@pytest.mark.parametrize("n", [pytest.param(64, marks=pytest.mark.slow), 4])
async def test_concurrent_sessions_record_what_a_replay_of_their_calls_gives(gateway, engine, n):
    trajectories = [new_trajectory(i) for i in range(n)]
    accesses = [gateway.open(t, seed=i) for i, t in enumerate(trajectories)]
    assert len({a.api_key for a in accesses}) == n and all(a.base_url.startswith("http://127.0.0.1:") for a in accesses)
    calls = await asyncio.gather(*(sdk_agent(a) for a in accesses))
    sessions = [gateway.sessions[a.session_id] for a in accesses]
    assert not any(s.rewrites for s in sessions) and all(s.calls == 3 for s in sessions)
    replays = []
    for i, (traj, replies) in enumerate(zip(trajectories, calls, strict=True)):
        assert len(traj.turns) == 3
        for turn, reply in zip(traj.turns, replies, strict=True):
            # what the agent was sent is what the trajectory holds, token for token, with the engine's logprobs
            assert reply.model_extra["prompt_token_ids"] == traj.token_ids[: turn.start]
            assert reply.choices[0].model_extra["token_ids"] == traj.token_ids[turn.start : turn.end]
            assert [t.logprob for t in reply.choices[0].logprobs.content] == traj.logprobs[turn.start : turn.end]
            assert set(traj.segments[turn.start : turn.end]) == {Segment.GENERATED}
            prompt = traj.token_ids[: turn.start]
            params = SAMPLING.model_copy(
                update={
                    "stop_token_ids": gateway.chat.chat.stop_token_ids,
                    "seed": zlib.crc32(f"{i}/{len(prompt)}".encode()),
                }
            )
            replays.append((traj, turn, engine.generate(prompt, params)))
        assert traj.versions[traj.turns[0].start :] and set(traj.policy_versions) == {0}
    # every turn sampled again from its recorded prompt and seed: the same tokens and logprobs
    for (traj, turn, _), gen in zip(replays, await asyncio.gather(*(r[2] for r in replays)), strict=True):
        assert gen.token_ids == traj.token_ids[turn.start : turn.end]
        torch.testing.assert_close(
            torch.tensor(gen.logprobs), torch.tensor(traj.logprobs[turn.start : turn.end]), atol=1e-4, rtol=0
        )


async def test_a_rewritten_history_starts_a_sequence(gateway):
    traj = new_trajectory()
    access = gateway.open(traj)
    async with client(access) as c:
        first = await c.chat.completions.create(model="policy", messages=OPENING, tools=TOOLS)
        n = len(traj.token_ids)
        summarised = [{"role": "system", "content": "Summary: the agent tried once."}, OPENING[1]]
        second = await c.chat.completions.create(
            model="policy", messages=summarised, tools=TOOLS, extra_body={"return_token_ids": True}
        )
    assert first.choices and second.choices[0].message is not None
    session = gateway.sessions[access.session_id]
    assert session.rewrites == 1 and session.calls == 2 and len(traj.turns) == 2
    # the second call's prompt (what the agent sent, laid out) is a sequence of its own, its reply trained there
    (seq,) = traj.sequences
    assert seq.start == n and seq.reason == "rewritten" and traj.context_start == n
    assert second.model_extra["prompt_token_ids"] == traj.token_ids[n : traj.turns[1].start]
    assert second.choices[0].model_extra["token_ids"] == traj.generated_ids(1)
    assert set(traj.segments[n : n + seq.prompt]) == {Segment.PROMPT} and not any(traj.loss_mask[n : n + seq.prompt])
    assert 0 < seq.new < seq.prompt and traj.episode_tokens == len(traj.token_ids) - seq.prompt + seq.new


async def test_a_retried_request_is_answered_from_the_record(gateway):
    traj = new_trajectory()
    access = gateway.open(traj)
    async with client(access) as c:
        a = await c.chat.completions.create(model="policy", messages=OPENING, tools=TOOLS)
        b = await c.chat.completions.create(model="policy", messages=OPENING, tools=TOOLS)  # the same body
        d = await c.chat.completions.create(
            model="policy", messages=OPENING, tools=TOOLS, max_tokens=7, extra_headers={"Idempotency-Key": "k1"}
        )
        e = await c.chat.completions.create(
            model="policy", messages=OPENING, tools=TOOLS, max_tokens=9, extra_headers={"Idempotency-Key": "k1"}
        )
    assert a.id == b.id and a.choices[0].message == b.choices[0].message
    assert d.id == e.id and d.id != a.id
    session = gateway.sessions[access.session_id]
    # d re-asked turn 0 (another budget: another body): a second branch, a sequence of its own
    assert session.retries == 2 and len(traj.turns) == 2 and session.rewrites == 1


async def test_bad_input_gets_an_openai_error_and_leaves_the_session_as_it_was(gateway):
    traj = new_trajectory()
    access = gateway.open(traj)
    async with client(access) as c:
        with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
            await c.chat.completions.create(model="policy", messages=OPENING, n=2)
        with pytest.raises(openai.BadRequestError, match="did not make"):
            await c.chat.completions.create(
                model="policy", messages=[*OPENING, {"role": "tool", "tool_call_id": "x", "content": "1"}]
            )
        with pytest.raises(openai.NotFoundError, match="not served here"):
            await c.chat.completions.create(model="gpt-4o", messages=OPENING)
        with pytest.raises(openai.BadRequestError, match="more than a context"):
            await c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x" * 10_000_000}])
        # a JavaScript agent that cut its tool's output inside an emoji sends half of it, escaped (JSON.stringify)
        body = json.dumps({"messages": [*OPENING[:-1], {"role": "user", "content": "a \ud83d"}]})
        headers = {"Authorization": f"Bearer {access.api_key}", "content-type": "application/json"}
        async with httpx.AsyncClient() as h:
            cut = await h.post(f"{access.base_url}/chat/completions", content=body, headers=headers)
        assert cut.status_code == 400 and "surrogate" in cut.json()["error"]["message"]
        r = await c.chat.completions.create(model="policy", messages=OPENING)
    session = gateway.sessions[access.session_id]
    assert session.calls == 1 and not session.rewrites and len(traj.turns) == 1 and r.choices


async def test_keys_are_per_session(gateway):
    a, b = gateway.open(new_trajectory(1)), gateway.open(new_trajectory(2))
    body = {"model": "policy", "messages": OPENING, "max_tokens": 2}
    async with httpx.AsyncClient() as h:
        url = f"{a.base_url}/chat/completions"
        assert (await h.post(url, json=body)).status_code == 401
        assert (await h.post(url, json=body, headers={"Authorization": f"Bearer {b.api_key}"})).status_code == 401
        assert (
            await h.get(f"{a.base_url}/models", headers={"Authorization": f"Bearer {a.api_key}"})
        ).status_code == 200
        await gateway.close_session(a.session_id)
        r = await h.post(url, json=body, headers={"Authorization": f"Bearer {a.api_key}"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


async def test_the_call_after_a_client_timeout_is_served(engine, chat):
    """An agent's SDK gives up on a long call (a timeout: the client disconnects): the gateway aborts the engine
    request, and its next call on the session, at once, is served rather than refused as a duplicate request id."""
    sampling = SamplingParams(temperature=1.0, max_tokens=400)
    async with Gateway(engine, chat, sampling=sampling, max_episode_tokens=4096) as g:
        access = g.open(Trajectory(episode_id="slow", group_id="g", task_id="t", sampling=sampling))
        messages = [{"role": "user", "content": "Write a long story."}]
        async with openai.AsyncOpenAI(
            base_url=access.base_url, api_key=access.api_key, max_retries=0, timeout=0.2
        ) as impatient:
            # no engine step runs meanwhile: a short reply (the policy may stop at once) cannot beat the timeout
            with engine.paused(), pytest.raises(openai.APITimeoutError):
                await impatient.chat.completions.create(model="policy", messages=messages)
        async with client(access) as c:
            r = await c.chat.completions.create(model="policy", messages=[*messages, *messages], max_tokens=4)
        assert r.choices[0].message is not None


async def summarise_and_go_on(access) -> tuple:
    """An agent that summarises its history after the first call, then appends to the summary as usual."""
    async with client(access) as c:
        await c.chat.completions.create(model="policy", messages=OPENING, tools=TOOLS)
        summary = [{"role": "system", "content": "Summary: the agent tried once."}, OPENING[1]]
        second = await c.chat.completions.create(
            model="policy", messages=summary, tools=TOOLS, extra_body={"return_token_ids": True}
        )
        message = second.choices[0].message
        results = [{"role": "tool", "tool_call_id": t.id, "content": "out"} for t in message.tool_calls or []]
        history = [*summary, message, *(results or [{"role": "user", "content": "Use a tool."}])]
        third = await c.chat.completions.create(
            model="policy", messages=history, tools=TOOLS, extra_body={"return_token_ids": True}
        )
    return second, third


async def test_a_history_that_goes_on_after_a_rewrite_stays_token_exact(gateway):
    """After a rewrite the agent's first assistant message is the session's second reply: it is found there (not
    re-encoded, which gives other ids for the same text about one time in four here), and the next call extends the
    rewritten sequence."""
    trajectories = [new_trajectory(i) for i in range(16)]
    accesses = [gateway.open(t, seed=i) for i, t in enumerate(trajectories)]
    calls = await asyncio.gather(*(summarise_and_go_on(a) for a in accesses))
    for traj, access, (second, third) in zip(trajectories, accesses, calls, strict=True):
        session = gateway.sessions[access.session_id]
        assert (session.rewrites, len(traj.sequences), len(traj.turns)) == (1, 1, 3)
        reply, prompt = second.choices[0].model_extra["token_ids"], third.model_extra["prompt_token_ids"]
        assert traj.generated_ids(1) == reply and prompt[: traj.turns[1].end - traj.context_start] == (
            second.model_extra["prompt_token_ids"] + reply
        )
        assert traj.context_ids == prompt + third.choices[0].model_extra["token_ids"]


async def test_a_call_waiting_for_its_turn_when_the_session_closes_is_refused(gateway):
    """A call queued behind one in flight (the session's lock held) when the episode ends gets 404 and is never
    generated: nobody records it, and the engine's time goes to live episodes."""
    traj = new_trajectory()
    access = gateway.open(traj)
    session = gateway.sessions[access.session_id]
    async with client(access) as c:
        async with session.lock:  # the call before it, in flight
            queued = asyncio.ensure_future(c.chat.completions.create(model="policy", messages=OPENING))
            while not session.lock._waiters:
                await asyncio.sleep(0.01)
            await gateway.close_session(access.session_id)
        with pytest.raises(openai.NotFoundError, match="is closed"):
            await queued
    assert session.calls == 0 and not traj.token_ids


async def test_session_calls_stay_out_of_the_serve_routes_reply_book(gateway):
    """The gateway finds replies in their session; `ChatCompletions.book` (agentrl serve's) would only grow."""
    access = gateway.open(new_trajectory())
    async with client(access) as c:
        r = await c.chat.completions.create(model="policy", messages=OPENING, tools=TOOLS)
    assert gateway.chat.book.find(ChatMessage.model_validate(r.choices[0].message.model_dump())) is None


async def test_an_aborted_reply_is_not_given_again_to_a_retry(gateway, engine):
    """The engine aborts a call (the session still open): the agent gets the cut reply, which the trajectory does not
    hold, and its retry of the same body is sampled anew, recorded, and from then on the reply a retry is given."""
    traj = new_trajectory()
    access = gateway.open(traj)
    body = {"model": "policy", "messages": OPENING, "extra_body": {"return_token_ids": True}}
    async with client(access) as c:
        with engine.paused():  # no decode step: the abort finds the call in flight
            cut = asyncio.ensure_future(c.chat.completions.create(**body))
            while access.session_id not in gateway.app.state.running:
                await asyncio.sleep(0.01)
            await engine.abort(access.session_id)
        cut = await cut
        retried = await c.chat.completions.create(**body)
        again = await c.chat.completions.create(**body)
    session = gateway.sessions[access.session_id]
    assert cut.choices[0].finish_reason == "abort" and retried.choices[0].finish_reason != "abort"
    assert retried.id != cut.id and again.id == retried.id and session.retries == 1
    assert len(traj.turns) == 1 and traj.generated_ids(0) == retried.choices[0].model_extra["token_ids"]


def bigram_policy(path, messages: list[dict], reply: str) -> list[int]:
    """A tiny model that answers `messages` with `reply` (then its stop token), whatever it samples: its layer adds
    nothing to the residual stream, so the next token is the last one's alone, each token of the chain pointing to
    the next. Returns the reply's token ids."""
    tok = load_tokenizer("qwen3")
    ids = [*tok.encode(reply, add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    chain = [ChatFormat(tok).prompt_ids(messages)[-1], *ids]
    assert len(set(chain)) == len(chain), "a token twice in the chain would have two successors"
    model = tiny_model("qwen3", num_hidden_layers=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight", "lm_head.weight")):
                p.zero_()
        for i, (a, b) in enumerate(itertools.pairwise(chain)):
            model.model.embed_tokens.weight[a, i] = 1.0
            model.lm_head.weight[b, i] = 20.0  # a logit of 160 after the norm: the others are never sampled
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return ids


async def test_logprob_bytes_are_each_tokens_own_and_join_into_the_reply(tmp_path):
    """OpenAI's `bytes`: a token that is a piece of a character has that piece's bytes (not U+FFFD's), so that the
    tokens' bytes joined are the reply's UTF-8; its `token` writes them escaped, as OpenAI does."""
    messages = [{"role": "user", "content": "Say it."}]
    ids = bigram_policy(tmp_path, messages, "café ✓")
    chat = ChatFormat(AutoTokenizer.from_pretrained(tmp_path))
    async with (
        build_engine(EngineConfig(), EngineModel(str(tmp_path))) as engine,
        Gateway(engine, chat, sampling=SAMPLING, max_episode_tokens=512) as g,
        client(g.open(new_trajectory())) as c,
    ):
        r = await c.chat.completions.create(
            model="policy", messages=messages, logprobs=True, extra_body={"return_token_ids": True}
        )
    assert r.choices[0].message.content == "café ✓" and r.choices[0].model_extra["token_ids"] == ids
    tokens = r.choices[0].logprobs.content
    assert b"".join(bytes(t.bytes) for t in tokens) == "café ✓<|im_end|>".encode()
    assert [t.token for t in tokens] == ["c", "a", "f", "\\xc3", "\\xa9", " ", "\\xe2", "\\x9c", "\\x93", "<|im_end|>"]

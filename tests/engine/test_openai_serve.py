"""`agentrl serve` as a real process and `OpenAIEngine` against it: the HTTP path gives the same
tokens and logprobs as the in-process `hf` engine, aborts keep partial tokens, weight updates
bump the version, errors name the problem, and the client retries a server that is not up yet."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess

import httpx
import openai
import pytest
import torch
from cli import listening_url, start_agentrl
from typer.testing import CliRunner
from vllm_standin import serving

from agentrl.cli import app as cli
from agentrl.engine import ContextTooLong, EngineConfig, EngineModel, SamplingParams, build_engine
from agentrl.engine.hf import HFEngine
from agentrl.engine.openai import OpenAIEngine, RequestRejected, ServerUnavailable
from agentrl.engine.server import create_app
from agentrl.models.tiny import save_tiny, tiny_model

ARCH = "qwen3_moe"
PROMPTS = [[1, 2, 3], list(range(100, 140)), [7] * 9, [42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SAMPLED = [
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=1234),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=24, seed=7),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, port: int = 0, *args: str) -> subprocess.Popen:
    """`agentrl serve` in the background, taking SIGINT as from a terminal."""
    return start_agentrl("serve", "--model", model_dir, "--port", port, *args)


def stop_server(proc: subprocess.Popen, sig: signal.Signals) -> str:
    """Send `sig`; the server must close its engine and exit 0. Returns its stderr."""
    try:
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert "agentrl serve: stopped" in stderr
    return stderr


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), ARCH, seed=0)


@pytest.fixture(scope="module")
def url(model_dir):
    # three decode steps between two reads back, against `local`'s one: what it returns over HTTP is the same
    proc = start_server(model_dir, 0, "--decode-window", "3")
    try:
        yield listening_url(proc)
    finally:
        stop_server(proc, signal.SIGINT)


@pytest.fixture(scope="module")
async def local(model_dir):
    """The same checkpoint in process: the reference the HTTP path must match."""
    engine = build_engine(EngineConfig(), EngineModel(str(model_dir)))
    yield engine
    await engine.close()


@pytest.fixture
async def remote(url):
    engine = OpenAIEngine(url)
    yield engine
    await engine.close()


def assert_same(remote_gen, local_gen) -> None:
    assert remote_gen.token_ids == local_gen.token_ids
    torch.testing.assert_close(torch.tensor(remote_gen.logprobs), torch.tensor(local_gen.logprobs), atol=1e-5, rtol=0)
    assert remote_gen.finish_reason == local_gen.finish_reason
    assert remote_gen.versions == local_gen.versions
    assert remote_gen.prompt_len == local_gen.prompt_len


async def test_connect_reads_model_and_context(remote, model_dir):
    await remote.connect()
    assert remote.model == str(model_dir)
    assert remote.max_context == 4096  # max_model_len from /v1/models
    assert remote.version == 0


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_greedy_matches_in_process(remote, local, prompt):
    assert_same(await remote.generate(prompt, GREEDY), await local.generate(prompt, GREEDY))


@pytest.mark.parametrize("params", SAMPLED)
async def test_seeded_sampling_matches_in_process(remote, local, params):
    for prompt in PROMPTS[:2]:
        assert_same(await remote.generate(prompt, params), await local.generate(prompt, params))


async def test_stop_token_ends_generation(remote, local):
    free = await local.generate(PROMPTS[0], GREEDY)
    stop = free.token_ids[5]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop,))
    gen = await remote.generate(PROMPTS[0], params)
    assert gen.finish_reason == "stop"
    assert gen.token_ids[-1] == stop and gen.token_ids == free.token_ids[: gen.token_ids.index(stop) + 1]


async def test_abort_returns_partial_tokens(remote, local):
    params = SamplingParams(temperature=0.0, max_tokens=3000)
    task = asyncio.create_task(remote.generate(PROMPTS[0], params, request_id="abort-me"))
    await asyncio.sleep(1.0)
    await remote.abort("abort-me")
    gen = await asyncio.wait_for(task, 30)
    assert gen.finish_reason == "aborted"
    assert 0 < len(gen.token_ids) < 3000
    assert len(gen.logprobs) == len(gen.versions) == len(gen.token_ids)
    prefix = await local.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=len(gen.token_ids)))
    assert gen.token_ids == prefix.token_ids  # the partial tokens are the real ones, not a restart


async def test_abort_before_the_server_has_it_closes_the_stream(remote, local):
    await remote.connect()
    task = asyncio.create_task(remote.generate(PROMPTS[1], SamplingParams(max_tokens=3000), request_id="early"))
    await asyncio.sleep(0)
    await remote.abort("early")
    gen = await asyncio.wait_for(task, 30)
    assert gen.finish_reason == "aborted"
    assert_same(await remote.generate(PROMPTS[0], GREEDY), await local.generate(PROMPTS[0], GREEDY))


async def test_more_requests_than_a_connection_pool_stream_at_once_and_abort_at_once(remote):
    """A request holds its connection while it streams: 110 of them all reach the server, and an abort (a POST of
    its own) goes at once (behind httpx's default pool of 100 it waited for a request to end by itself: 7 min)."""
    await remote.connect()
    params = SamplingParams(temperature=1.0, max_tokens=remote.max_context - 8)
    rids = [f"pool-{i}" for i in range(110)]
    tasks = [asyncio.create_task(remote.generate([1, 2, 3], params, request_id=r)) for r in rids]

    def streaming() -> int:
        return sum(st.started.is_set() for st in remote._inflight.values())

    try:
        for _ in range(600):
            if streaming() == len(rids):
                break
            await asyncio.sleep(0.05)
        assert streaming() == len(rids), "a request waited for a connection"
        await asyncio.wait_for(remote.abort(rids[0]), 10)
        assert (await asyncio.wait_for(tasks[0], 10)).finish_reason == "aborted"
    finally:  # the callers give up: their streams close, and the server drops the requests
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_engine_request(url, stream):
    """Once the client is gone the engine drops the request: its id is free again within seconds
    (the 2000 tokens it asked for take the tiny CPU model about a minute)."""
    body = {"prompt": [1, 2, 3], "max_tokens": 2000, "request_id": f"gone-{stream}", "stream": stream}
    async with httpx.AsyncClient(base_url=url, timeout=1.0) as client:
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                await anext(resp.aiter_lines())  # the server holds the request; now hang up
        else:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=body)
    async with httpx.AsyncClient(base_url=url) as client:
        for _ in range(50):
            resp = await client.post("/v1/completions", json={**body, "max_tokens": 1, "stream": False})
            if resp.status_code == 200:
                return
            assert "already in flight" in resp.json()["error"]["message"]
            await asyncio.sleep(0.1)
    raise AssertionError("the engine still holds the request of a client that disconnected")


async def test_reply_shape_and_stream_chunks(url):
    body = {
        "prompt": [[1, 2, 3]],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    async with httpx.AsyncClient(base_url=url) as client:
        reply = (await client.post("/v1/completions", json=body)).json()
        choice = reply["choices"][0]
        assert reply["object"] == "text_completion" and isinstance(choice["text"], str)
        assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert choice["policy_versions"] == choice["policy_kv_versions"] == [0] * 5
        assert choice["prompt_token_ids"] == [1, 2, 3]
        assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/completions", json=stream_body) as resp:
            events = [line.removeprefix("data: ") async for line in resp.aiter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[1:-3]]
    assert [c["token_ids"] for c in chunks] == [[t] for t in choice["token_ids"]]
    # the stream's prompt KV comes from the prefix cache (the reply's): equal up to float rounding
    streamed = [c["logprobs"]["token_logprobs"][0] for c in chunks]
    assert streamed == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)
    assert all(c["policy_versions"] == c["policy_kv_versions"] == [0] and c["finish_reason"] is None for c in chunks)
    finish, usage = json.loads(events[-3]), json.loads(events[-2])
    assert finish["choices"][0]["finish_reason"] == "length" and finish.get("usage") is None
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5  # its own chunk, as OpenAI sends it


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"prompt": "hello"}, "text prompts are not accepted"),
        ({"prompt": ["hello", "world"]}, "text prompts are not accepted"),
        ({"prompt": [1, 2], "temprature": 0.5}, "temprature"),
        ({"prompt": [1, 2], "n": 2}, "n=2 is not supported"),
        ({"prompt": [1, 2], "logprobs": 5}, "logprobs=5 is not supported"),
        ({"prompt": [[1], [2]]}, "one prompt per request"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, 2], "temperature": 0, "top_p": 0.5}, "top_p"),
        ({"prompt": [1, 2], "stop": ["\n"]}, "stop_token_ids"),
    ],
)
async def test_bad_requests_get_400_naming_the_problem(url, body, says):
    async with httpx.AsyncClient(base_url=url) as client:
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 400
    assert says in resp.json()["error"]["message"]


async def test_client_raises_what_the_server_refused(url, remote):
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        await remote.generate([10**7], GREEDY)
    with pytest.raises(RequestRejected, match="PeftModel"):
        await remote.update_weights(lora={"x": torch.zeros(1)})
    other = OpenAIEngine(url, model="no-such-model")
    with pytest.raises(RequestRejected, match="does not serve model 'no-such-model'"):
        await other.connect()
    await other.close()


async def test_weight_update_mid_request_later_tokens_are_newer_than_their_kv():
    """A weight update landing mid-request: the tokens after it carry the new version and still the old KV
    version (the prompt's and earlier tokens' KV came from the old weights). Both come from the server: the
    client sends at version 0, not knowing that another client's update made it 1."""
    engine = HFEngine(tiny_model("qwen3", seed=0))
    async with serving(create_app(engine, model_name="tiny")) as url, OpenAIEngine(url) as client:
        async with OpenAIEngine(url) as learner:
            assert await learner.update_weights(tiny_model("qwen3", seed=5).state_dict()) == 1
            assert client.version == 0
            running = asyncio.create_task(
                client.generate([1, 2, 3], SamplingParams(max_tokens=3000, seed=0), request_id="long")
            )
            await asyncio.sleep(0.3)
            assert await learner.update_weights(tiny_model("qwen3", seed=6).state_dict()) == 2
        await asyncio.sleep(0.2)
        await client.abort("long")  # its tokens so far, some sampled after the update
        gen = await running
    await engine.close()
    assert gen.finish_reason == "aborted"
    assert gen.versions[0] == 1 and gen.versions[-1] == 2 and gen.versions == sorted(gen.versions)
    assert set(gen.kv_versions) == {1}
    assert client.version == 2  # learnt from the tokens


async def test_context_too_long(url, remote):
    with pytest.raises(ContextTooLong):  # checked here, before any request
        await remote.generate([1] * 10, SamplingParams(max_tokens=4090))
    unchecked = OpenAIEngine(url, max_context=10**6)
    with pytest.raises(ContextTooLong, match=r"HTTP 400.*exceeds the context of 4096"):  # refused by the server
        await unchecked.generate([1] * 10, SamplingParams(max_tokens=4090))
    await unchecked.close()


@pytest.mark.slow  # waits out the client's retries; the fast tier syncs weights over HTTP below
async def test_retries_until_the_server_is_up_then_takes_weights(model_dir, local):
    port = free_port()
    client = OpenAIEngine(f"http://127.0.0.1:{port}/v1", max_retries=40, retry_backoff_s=0.25)
    first = asyncio.create_task(client.generate(PROMPTS[0], GREEDY))
    await asyncio.sleep(0.5)  # the client is retrying a refused connection by now
    proc = start_server(model_dir, port)
    try:
        assert_same(await asyncio.wait_for(first, 120), await local.generate(PROMPTS[0], GREEDY))

        new_weights = tiny_model(ARCH, seed=1)
        assert await client.update_weights(new_weights.state_dict()) == 1 == client.version
        reference = HFEngine(new_weights)
        gen = await client.generate(PROMPTS[1], GREEDY)
        assert gen.versions == [1] * len(gen.token_ids)
        assert gen.token_ids == (await reference.generate(PROMPTS[1], GREEDY)).token_ids
        assert gen.token_ids != (await local.generate(PROMPTS[1], GREEDY)).token_ids  # the old weights differ
        await reference.close()

        # SIGTERM: the running request ends at once with its tokens, then the server exits 0.
        running = asyncio.create_task(client.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=3000)))
        await asyncio.sleep(1.0)
        await asyncio.to_thread(stop_server, proc, signal.SIGTERM)
        cut = await asyncio.wait_for(running, 10)
        assert cut.finish_reason == "aborted" and 0 < len(cut.token_ids) < 3000
        assert cut.versions == [1] * len(cut.token_ids)
    finally:
        await client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_connection_refused_after_retries_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"
    client = OpenAIEngine(url, max_retries=2, retry_backoff_s=0.01)
    with pytest.raises(ServerUnavailable, match=rf"no answer from {url} after 3 attempts: ConnectError"):
        await client.generate([1, 2], GREEDY)
    await client.close()


def test_serve_needs_a_model():
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2 and "--model DIR" in result.output


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tiny", "llama", "--lora-rank", "4", "--lora-experts"], "no fused expert parameters"),
        (["--tiny", "qwen3_moe", "--lora-rank", "-1"], "greater than or equal to 1"),
        (["--tiny", "qwen3_moe", "--lora-rank", "4", "--engine", "vllm"], "pip install 'agentrl[vllm]'"),
        (["--tiny", "qwen3_moe", "--engine", "vlm"], "Did you mean 'vllm'?"),
        (["--tiny", "qwen3_moe", "--engine", "vllm", "--decode-window", "4"], "decode_window sets the hf engine"),
    ],
)
def test_serve_refuses_a_bad_setting_in_one_line(args, says):
    result = CliRunner().invoke(cli, ["serve", *args])
    assert result.exit_code == 2 and says in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("lora", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["full", "lora"])
async def test_trainer_weights_reach_agentrl_serve(model_dir, lora):
    """A GSPO-token update, synced over HTTP (full weights, or a LoRA adapter on attention and
    experts): the server then samples with the trained weights."""
    from agentrl.models.lora import LoraSettings
    from agentrl.train.batch import TrainBatch
    from agentrl.train.config import ModelConfig, OptimConfig, TrainerConfig
    from agentrl.train.learner import LocalLearner
    from agentrl.train.policy import load_policy
    from agentrl.train.trainer import Trainer
    from agentrl.train.weight_sync import weight_sync

    model = ModelConfig(path=str(model_dir), lora=LoraSettings(rank=4, alpha=8, experts=True) if lora else None)
    trainer = Trainer(TrainerConfig(model=model, optim=OptimConfig(lr=1e-2, minibatches=1)), load_policy(model))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 2000, (4, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[:, :8] = 0
    trainer.update(
        TrainBatch(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            loss_mask=mask,
            old_logprobs=-5.0 * mask,
            advantages=torch.randn(4, 24, generator=g) * mask,
            sampling=SamplingParams(),
        )
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = ids[0, :8].tolist()
    # its own server: the module's shared one keeps the original weights
    proc = start_server(model_dir, 0, *(["--lora-rank", "4", "--lora-alpha", "8", "--lora-experts"] if lora else []))
    try:
        async with OpenAIEngine(listening_url(proc)) as remote:
            before = await remote.generate(prompt, greedy)
            assert await weight_sync(LocalLearner(trainer, in_thread=False), remote).push() == 1
            after = await remote.generate(prompt, greedy)
    finally:
        stop_server(proc, signal.SIGINT)

    def rescored(tokens):
        x = torch.tensor([prompt + tokens])
        with torch.no_grad():
            return trainer.scorer(x, torch.ones_like(x), greedy)[0][0, len(prompt) :]

    assert set(after.versions) == {1}
    torch.testing.assert_close(torch.tensor(after.logprobs), rescored(after.token_ids), atol=1e-4, rtol=0)
    assert (rescored(before.token_ids) - torch.tensor(before.logprobs)).abs().max() > 1e-2


async def test_a_keyless_server_answers_loopback_names_alone(url):
    """Without a key `agentrl serve` listens on loopback alone, but a web page this machine's browser opens could
    still reach it under a DNS name of its own that resolves to 127.0.0.1 (rebinding), and upload weights: only
    the Host it names tells the two apart. Every loopback address is this machine (`--host 127.0.0.2` is served)."""
    port = httpx.URL(url).port
    async with httpx.AsyncClient() as c:
        for host in ("127.0.0.1", "localhost", "127.0.0.2", "[::1]", "[0:0:0:0:0:0:0:1]"):
            assert (await c.get(f"{url}/v1/models", headers={"Host": f"{host}:{port}"})).status_code == 200, host
        rebound = await c.post(f"{url}/agentrl/weights", headers={"Host": f"attacker.example:{port}"}, content=b"x")
        assert rebound.status_code == 400
        assert "'attacker.example:" in rebound.json()["error"]["message"]


async def test_a_keyless_server_refuses_requests_from_web_pages(url):
    """A page of any site can POST bytes without a content type to http://127.0.0.1 (a "simple" request: no CORS
    preflight asks first, and the reply, unread, does not matter): it would install its weights. The browser names
    the page's origin; clients that are no browser send none, and a loopback page is this machine's own."""
    async with httpx.AsyncClient() as c:
        before = (await c.get(f"{url}/agentrl/version")).json()["version"]
        for origin in ("https://attacker.example", "null"):  # "null": a sandboxed frame, a file:// page
            r = await c.post(f"{url}/agentrl/weights", headers={"Origin": origin}, content=b"x")
            assert r.status_code == 403 and "web pages" in r.json()["error"]["message"], origin
        assert (await c.get(f"{url}/agentrl/version")).json()["version"] == before
        local = await c.get(f"{url}/v1/models", headers={"Origin": f"http://localhost:{httpx.URL(url).port}"})
        assert local.status_code == 200


@pytest.mark.slow  # a server of its own
async def test_an_ipv6_server_prints_a_url_clients_take(model_dir):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    proc = start_server(model_dir, 0, "--host", "::1")
    try:
        url = listening_url(proc)
        assert url.startswith("http://[::1]:")
        models = await openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0).models.list()
        assert [m.id for m in models.data] == [str(model_dir)]
    finally:
        stop_server(proc, signal.SIGINT)

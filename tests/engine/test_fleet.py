"""The fleet: hf replicas as real Ray actors behind one engine (tiny models, CPU), against the learner's module
and a single in-process engine."""

import asyncio
import contextlib
import os
import signal
import time

import pytest
import ray
import torch
from cli import serving
from peft import get_peft_model_state_dict
from pydantic import ValidationError
from test_hf import teacher_forced
from vllm_standin import VLLMStandIn
from vllm_standin import serving as serve_app

from agentrl.engine import EngineConfig, EngineModel, build_engine, engine_unavailable
from agentrl.engine.base import SamplingParams
from agentrl.engine.fleet import Fleet, FleetDown
from agentrl.engine.hf import HFEngine
from agentrl.models.lora import LoraSettings, with_lora
from agentrl.models.tiny import save_tiny, tiny_model
from agentrl.models.tokenizer import load_tokenizer

ARCH = "qwen3"
FP32_ATOL = 1e-5  # the same float32 computation in another process, another batch: measured ~1e-6
BF16_ATOL = 1e-2  # bfloat16-rounded weights against the learner's float32 ones: measured ~1.5e-3
SLACK = 256  # affinity_slack_tokens of the shared fleet
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)

TOK = load_tokenizer()
PROMPT = TOK.encode("def add(a, b):")


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray for this module: 4 logical CPUs, two fleets of two replicas reserving one each."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), ARCH, seed=0)


@pytest.fixture(scope="module")
async def fleet(ray_local, model_dir):
    """Two float32 replicas, shared by the tests of this module; each test sends the weights it needs."""
    async with build_engine(EngineConfig(replicas=2, affinity_slack_tokens=SLACK), EngineModel(str(model_dir))) as f:
        yield f


def requests_per_replica(fleet: Fleet) -> list[int]:
    return [r.requests for r in fleet.fleet_stats().replicas]


async def assert_every_replica_matches(fleet: Fleet, learner: torch.nn.Module, atol: float) -> float:
    """One greedy request per replica (sent together: the second goes to the idle one); each matches the
    learner's teacher-forced logprobs within `atol`. Returns the largest difference."""
    before = requests_per_replica(fleet)
    gens = await asyncio.gather(*(fleet.generate(PROMPT, GREEDY) for _ in before))
    assert [a - b for a, b in zip(requests_per_replica(fleet), before, strict=True)] == [1] * len(before)
    assert [r.version for r in fleet.fleet_stats().replicas] == [fleet.version] * len(before)
    worst = 0.0
    for gen in gens:
        assert gen.versions == [fleet.version] * GREEDY.max_tokens and gen.finish_reason == "length"
        expected = teacher_forced(learner, PROMPT, gen, GREEDY)
        worst = max(worst, (torch.tensor(gen.logprobs) - expected).abs().max().item())
    assert worst <= atol
    return worst


async def test_weight_update_reaches_every_replica(fleet):
    learner = tiny_model(ARCH, seed=5)
    version = fleet.version
    assert await fleet.update_weights(learner.state_dict()) == version + 1 == fleet.version
    await assert_every_replica_matches(fleet, learner, FP32_ATOL)
    caps = fleet.capabilities
    assert caps.dtype == "float32" and caps.weight_updates == {"full"} and not caps.shares_module and not caps.pausable


async def test_requests_in_flight_go_on_through_a_weight_update(fleet):
    version = fleet.version
    task = asyncio.create_task(fleet.generate(PROMPT, SamplingParams(max_tokens=1500, seed=0)))
    await asyncio.sleep(0.3)  # generating
    await fleet.update_weights(tiny_model(ARCH, seed=11).state_dict())
    gen = await task
    assert gen.versions[0] == version and gen.versions[-1] == version + 1 and gen.versions == sorted(gen.versions)
    assert set(gen.kv_versions) == {version}, "later tokens were sampled over KV the old weights computed"


@pytest.mark.slow  # 23 s: the fast tier updates every replica's weights in test_weight_update_reaches_every_replica
async def test_bfloat16_weight_replicas_take_updates_rounded(ray_local, model_dir):
    """Replicas with bf16-rounded weights (float32 compute) round every update; closing the fleet kills its
    actors and leaves the Ray it did not start running."""
    cfg = EngineConfig(replicas=2, dtype="bfloat16_weights")
    async with build_engine(cfg, EngineModel(str(model_dir)), version=3) as fleet:
        learner = tiny_model(ARCH, seed=5)
        assert await fleet.update_weights(learner.state_dict()) == 4
        assert fleet.capabilities.dtype == "bfloat16_weights"
        worst = await assert_every_replica_matches(fleet, learner, BF16_ATOL)
        assert worst > FP32_ATOL, "the replicas sample with the learner's unrounded weights"
        pids = [r.pid for r in fleet.fleet_stats().replicas]
    assert ray.is_initialized()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "the replica actors outlived the fleet"
        await asyncio.sleep(0.2)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_fleet_samples_as_one_engine(fleet):
    """Greedy and seeded sampling through the fleet (both replicas) give one in-process engine's tokens and
    logprobs with the same weights."""
    learner = tiny_model(ARCH, seed=7)
    await fleet.update_weights(learner.state_dict())
    prompts = [TOK.encode(p) for p in ["def add(a, b):", "Write a function", "x", "hello " * 9]]
    params = [GREEDY, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16)]
    jobs = [(p, sp.model_copy(update={"seed": i})) for i, p in enumerate(prompts) for sp in params]
    before = requests_per_replica(fleet)
    gens = await asyncio.gather(*(fleet.generate(p, sp) for p, sp in jobs))
    assert all(a > b for a, b in zip(requests_per_replica(fleet), before, strict=True)), "a replica was left out"
    async with HFEngine(learner) as single:
        expected = await asyncio.gather(*(single.generate(p, sp) for p, sp in jobs))
    for gen, exp in zip(gens, expected, strict=True):
        assert gen.token_ids == exp.token_ids and gen.finish_reason == exp.finish_reason
        torch.testing.assert_close(torch.tensor(gen.logprobs), torch.tensor(exp.logprobs), atol=FP32_ATOL, rtol=0)
        assert gen.versions == [fleet.version] * len(gen.token_ids)


async def test_an_episode_stays_on_its_replica_unless_it_is_overloaded(fleet):
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    obs = TOK.encode("<|im_end|>observation: ok")
    stats = fleet.fleet_stats()

    async def turn(prompt: list[int], replica: int) -> list[int]:
        before = requests_per_replica(fleet)
        gen = await fleet.generate(prompt, params, request_id="episode")
        after = requests_per_replica(fleet)
        assert after[replica] == before[replica] + 1, f"went to another replica than {replica}: {before} -> {after}"
        return prompt + gen.token_ids + obs

    async def busy(max_tokens: int) -> asyncio.Task:
        """A request on replica 0 (the idle fleet's first choice), outstanding work max_tokens + 1."""
        rid = f"busy-{max_tokens}"
        task = asyncio.create_task(fleet.generate([1], SamplingParams(max_tokens=max_tokens), request_id=rid))
        await asyncio.sleep(0)  # routed
        assert fleet.fleet_stats().replicas[0].in_flight == 1
        return task

    prompt = await turn(PROMPT, 0)
    # replica 0 has more work than replica 1, within the slack: the episode stays where its prefix is cached
    task = await busy(SLACK // 2)
    prompt = await turn(prompt, 0)
    await task
    # overloaded: more than the slack above replica 1's work
    task = await busy(4 * SLACK)
    await turn(prompt, 1)
    await fleet.abort(f"busy-{4 * SLACK}")
    assert (await task).finish_reason == "aborted"
    now = fleet.fleet_stats()
    assert (now.affinity_hits - stats.affinity_hits, now.affinity_misses - stats.affinity_misses) == (1, 1)
    assert now.affinity_hit_rate == now.affinity_hits / (now.affinity_hits + now.affinity_misses)
    assert now.metrics()["fleet/affinity_hit_rate"] == now.affinity_hit_rate


async def test_abort_reaches_the_replica_and_the_request_resumes(fleet):
    task = asyncio.create_task(fleet.generate(PROMPT, SamplingParams(max_tokens=2000, seed=1), request_id="ep"))
    await asyncio.sleep(1.0)
    await fleet.abort("ep")
    gen = await task
    assert gen.finish_reason == "aborted" and len(gen.token_ids) < 2000
    assert len(gen.logprobs) == len(gen.versions) == len(gen.token_ids)
    await fleet.abort("no-such-request")  # ignored
    # a partial rollout resumes under the same id, on whichever replica
    resumed = await fleet.generate(PROMPT + gen.token_ids, SamplingParams(max_tokens=6), request_id="ep")
    assert resumed.finish_reason == "length" and len(resumed.token_ids) == 6
    # an abort right behind its request (the actor may take the two in either order) still ends it
    task = asyncio.create_task(fleet.generate(PROMPT, SamplingParams(max_tokens=2000), request_id="ep2"))
    await asyncio.sleep(0)  # sent to its replica
    await fleet.abort("ep2")
    assert (await task).finish_reason == "aborted"


@pytest.mark.slow  # the fast tier kills an env worker: tests/rollout/test_controller.py
async def test_a_killed_replica_is_retried_elsewhere_and_restarted(fleet):
    learner = tiny_model(ARCH, seed=9)
    version = await fleet.update_weights(learner.state_dict())
    params = SamplingParams(temperature=1.0, max_tokens=1500, seed=3)  # a few seconds: killed mid-request
    stats = fleet.fleet_stats()
    task = asyncio.create_task(fleet.generate(PROMPT, params, request_id="doomed"))
    await asyncio.sleep(0)  # routed
    (victim,) = [i for i, r in enumerate(fleet.fleet_stats().replicas) if r.in_flight]
    await asyncio.sleep(0.3)  # generating
    os.kill(stats.replicas[victim].pid, signal.SIGKILL)
    gen = await task
    # the caller sees the request as an undisturbed engine serves it
    async with HFEngine(learner) as single:
        expected = await single.generate(PROMPT, params)
    assert gen.token_ids == expected.token_ids and gen.finish_reason == "length"
    assert gen.versions == [version] * params.max_tokens
    torch.testing.assert_close(
        torch.tensor(gen.logprobs), teacher_forced(learner, PROMPT, gen, params), atol=FP32_ATOL, rtol=0
    )
    assert fleet.fleet_stats().retried == stats.retried + 1
    deadline = time.monotonic() + 120
    while (now := fleet.fleet_stats().replicas[victim]).restarts == stats.replicas[victim].restarts:
        assert time.monotonic() < deadline, "the replica was not restarted"
        await asyncio.sleep(0.2)
    assert now.pid != stats.replicas[victim].pid and now.version == version
    await assert_every_replica_matches(fleet, learner, FP32_ATOL)  # the new replica holds the current weights


async def test_a_replica_that_dies_during_a_weight_update_stays_down_until_restarted(fleet):
    """Replica 0 takes an update while replica 1, stopped, holds it up; replica 0 then dies and a request finds it
    dead: once the update ends, replica 0 is still down (restarting), not counted up for having taken it, so no
    request goes to it and it restarts once."""
    learner = tiny_model(ARCH, seed=13)
    stats = fleet.fleet_stats()
    (p0, p1), version = (r.pid for r in stats.replicas), fleet.version
    os.kill(p1, signal.SIGSTOP)
    try:
        update = asyncio.create_task(fleet.update_weights(learner.state_dict()))
        # replica 0 (the idle fleet's first choice) has taken it once its tokens carry the new version
        while (await fleet.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1))).versions != [version + 1]:
            await asyncio.sleep(0.1)
        os.kill(p0, signal.SIGKILL)
        found_dead = asyncio.create_task(fleet.generate(PROMPT, GREEDY))  # goes on to replica 1, stopped
        while fleet.fleet_stats().replicas[0].version is not None:
            await asyncio.sleep(0.05)
    finally:
        os.kill(p1, signal.SIGCONT)
    assert await update == version + 1
    await found_dead
    assert fleet.fleet_stats().replicas[0].version is None, "the dead replica counts as up"
    await fleet.generate(PROMPT, GREEDY)  # to replica 1: replica 0 is restarting
    assert fleet.fleet_stats().retried == stats.retried + 1, "a request was sent to the dead replica"
    deadline = time.monotonic() + 120
    while (now := fleet.fleet_stats().replicas[0]).version is None:
        assert time.monotonic() < deadline, "the replica was not restarted"
        await asyncio.sleep(0.2)
    assert now.restarts == stats.replicas[0].restarts + 1 and now.version == version + 1
    await assert_every_replica_matches(fleet, learner, FP32_ATOL)


@pytest.mark.slow
async def test_lora_replicas_take_adapters_and_a_restart_gets_the_latest(ray_local, model_dir):
    """Replicas with the policy's adapters take LoRA updates; a replica that died comes back as the base
    weights plus the latest adapter."""
    settings = LoraSettings(rank=4, alpha=8)
    learner = with_lora(tiny_model(ARCH, seed=0), settings)  # the base model_dir holds, adapters trained below
    async with build_engine(EngineConfig(replicas=2), EngineModel(str(model_dir), lora=settings)) as fleet:
        assert fleet.capabilities.weight_updates == {"full", "lora"}
        for step in range(2):
            with torch.no_grad():
                for name, p in learner.named_parameters():
                    if "lora_" in name:
                        p.copy_(torch.randn_like(p) * 0.3)
            assert await fleet.update_weights(lora=get_peft_model_state_dict(learner)) == step + 1
        await assert_every_replica_matches(fleet, learner, FP32_ATOL)
        os.kill(fleet.fleet_stats().replicas[0].pid, signal.SIGKILL)
        await fleet.generate(PROMPT, GREEDY)  # the idle fleet's first choice: finds replica 0 dead, goes to 1
        deadline = time.monotonic() + 120
        while fleet.fleet_stats().replicas[0].restarts == 0:
            assert time.monotonic() < deadline, "the replica was not restarted"
            await asyncio.sleep(0.2)
        await assert_every_replica_matches(fleet, learner, FP32_ATOL)


@pytest.mark.slow
async def test_a_fleet_whose_replicas_cannot_come_back_says_so(ray_local, model_dir, tmp_path):
    """Its one replica killed and its model folder gone, the restart fails: requests raise a clear error."""
    path = save_tiny(tmp_path / "doomed", ARCH, seed=0)
    async with Fleet(EngineConfig(replicas=1), EngineModel(str(path))) as fleet:
        (replica,) = fleet.fleet_stats().replicas
        for f in path.iterdir():
            f.unlink()
        os.kill(replica.pid, signal.SIGKILL)
        with pytest.raises(FleetDown, match="none could be restarted"):
            await fleet.generate(PROMPT, GREEDY)


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"kind": "openai", "replicas": 2, "base_url": "http://a"}, "list them in engine.base_urls"),
        ({"base_urls": ["http://a", "http://b"]}, "need engine.kind=openai"),
        ({"kind": "openai", "base_url": "http://a", "base_urls": ["http://b"]}, "base_url is required"),
        ({"kind": "openai", "base_urls": ["http://a", "http://a"]}, "lists a server twice"),
        ({"threads_per_replica": 2}, "needs engine.kind=hf and engine.replicas"),
        ({"ray_address": "ray://head:10001"}, "needs engine.replicas"),
        ({"kind": "vllm", "replicas": 2, "vllm": {"tensor_parallel_size": 2}}, "one vllm engine per GPU"),
    ],
)
def test_fleet_settings_are_checked_at_load(settings, says):
    with pytest.raises(ValidationError, match=says):
        EngineConfig(**settings)


def test_replicas_load_their_weights_from_the_model_path():
    with pytest.raises(ValueError, match=r"EngineModel\.path"):
        build_engine(EngineConfig(replicas=2), EngineModel(module=tiny_model(ARCH)))


def test_every_server_of_a_fleet_is_checked_up_front():
    cfg = EngineConfig(kind="openai", base_urls=["http://127.0.0.1:9", "http://127.0.0.1:7"])
    assert "http://127.0.0.1:9/v1/models does not answer" in engine_unavailable(cfg)


@pytest.mark.slow
async def test_a_fleet_of_agentrl_servers_takes_weights_and_shares_requests(model_dir):
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serving("--model", model_dir)) for _ in range(2)]
        cfg = EngineConfig(kind="openai", base_urls=urls)
        assert engine_unavailable(cfg) is None
        async with build_engine(cfg, EngineModel(str(model_dir))) as fleet:
            learner = tiny_model(ARCH, seed=5)
            assert await fleet.update_weights(learner.state_dict()) == 1
            await assert_every_replica_matches(fleet, learner, FP32_ATOL)


@pytest.fixture
async def standins(model_dir):
    """Two stand-ins of `vllm serve` (tests/engine/vllm_standin.py) for the tiny model: servers that report no
    policy version."""
    servers = [VLLMStandIn(model_dir) for _ in range(2)]
    yield servers
    for server in servers:
        await server.close()


async def test_a_fleet_of_vllm_servers_keeps_the_version_it_starts_from(standins, model_dir, tmp_path):
    """A resumed run's fleet of servers that report no version (vLLM) goes on from the run's version."""
    async with serve_app(standins[0].app) as a, serve_app(standins[1].app) as b:
        cfg = EngineConfig(kind="openai", base_urls=[a, b], server="vllm", weights_dir=str(tmp_path))
        async with build_engine(cfg, EngineModel(str(model_dir)), version=3) as fleet:
            assert fleet.version == 3
            learner = tiny_model(ARCH, seed=5)
            assert await fleet.update_weights(learner.state_dict()) == 4
            await assert_every_replica_matches(fleet, learner, FP32_ATOL)


@pytest.mark.slow  # 25 s: a request gives up on a stopped server after the client's retries (~15 s)
async def test_a_vllm_server_back_after_an_outage_gets_the_current_adapter(standins, model_dir, tmp_path):
    """A server that stops answering is left, and its client started again once it is back: it loads the
    latest adapter under a new name, at the fleet's version (vLLM reports none), and samples the learner's."""
    settings = LoraSettings(rank=4, alpha=8)
    learner = with_lora(tiny_model(ARCH, seed=0), settings)
    with torch.no_grad():
        for name, p in learner.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    outage = contextlib.AsyncExitStack()
    a = await outage.enter_async_context(serve_app(standins[0].app))
    async with outage, serve_app(standins[1].app) as b:
        cfg = EngineConfig(kind="openai", base_urls=[a, b], server="vllm", weights_dir=str(tmp_path))
        async with build_engine(cfg, EngineModel(str(model_dir), lora=settings)) as fleet:
            assert await fleet.update_weights(lora=get_peft_model_state_dict(learner)) == 1
            await outage.aclose()  # server 0 stops answering; it keeps its adapters
            await fleet.generate(PROMPT, GREEDY)  # to server 0, the idle fleet's first choice: retried on 1
            assert fleet.fleet_stats().retried == 1
            async with serve_app(standins[0].app, int(a.rsplit(":", 1)[1])):  # back while its client restarts
                deadline = time.monotonic() + 30
                while fleet.fleet_stats().replicas[0].restarts == 0:
                    assert time.monotonic() < deadline, "the replica was not restarted"
                    await asyncio.sleep(0.2)
                assert fleet.fleet_stats().replicas[0].version == 1
                await assert_every_replica_matches(fleet, learner, FP32_ATOL)

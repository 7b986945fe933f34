"""`OpenAIEngine` against a vLLM server (`vllm serve`): weight updates reach it through vLLM's own endpoints
and a shared folder, and its tokens carry conservative versions. vLLM cannot run here (no GPU): the server is
`vllm_standin`, which speaks those endpoints as vLLM 0.16.0 does, backed by the hf engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from peft import get_peft_model_state_dict
from transformers import AutoModelForCausalLM
from vllm_standin import VLLMStandIn, serving

from agentrl.engine import EngineConfig, EngineModel, SamplingParams, build_engine
from agentrl.engine.openai import OpenAIEngine, RequestRejected, ServerError
from agentrl.engine.sampling import token_logprobs
from agentrl.models.lora import LoraSettings, with_lora
from agentrl.models.tiny import save_tiny, tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPT = [5, 17, 42, 7]
LORA = LoraSettings(rank=4, alpha=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"), "qwen3", seed=0)


@pytest.fixture
async def standin(model_dir):
    server = VLLMStandIn(model_dir)
    yield server
    await server.close()


def scored(model, prompt, gen) -> torch.Tensor:
    """The learner's logprobs of the generated tokens (teacher-forced, greedy semantics)."""
    ids = torch.tensor([prompt + gen.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(gen.token_ids), GREEDY)


async def test_lora_update_serves_the_learners_adapter_under_a_new_name(standin, model_dir, tmp_path):
    torch.manual_seed(0)
    learner = with_lora(AutoModelForCausalLM.from_pretrained(model_dir), LORA)
    async with serving(standin.app) as url:
        cfg = EngineConfig(kind="openai", base_url=url, weights_dir=str(tmp_path))
        async with build_engine(cfg, EngineModel(str(model_dir), lora=LORA)) as client:
            assert client.capabilities.weight_updates == {"full", "lora"}  # detected: not agentrl serve
            names = []
            for version in (1, 2):
                with torch.no_grad():  # the learner's adapter after a training step: B no longer zero
                    for name, p in learner.named_parameters():
                        if "lora_" in name:
                            p.normal_(0, 0.3)
                assert await client.update_weights(lora=get_peft_model_state_dict(learner)) == version
                gen = await client.generate(PROMPT, GREEDY)
                torch.testing.assert_close(torch.tensor(gen.logprobs), scored(learner, PROMPT, gen), atol=1e-4, rtol=0)
                assert gen.versions == gen.kv_versions == [version] * len(gen.token_ids)
                names.append(next(iter(standin.adapters)))
    assert names[0] != names[1] and names[1].endswith("-v2")
    assert list(standin.adapters) == [names[1]]  # the previous adapter was unloaded after the switch
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)  # v1's folder stays for requests in flight
    base = await standin.base.generate(PROMPT, GREEDY)  # the base weights did not move
    torch.testing.assert_close(torch.tensor(base.logprobs), scored(tiny_model("qwen3", seed=0), PROMPT, base))


async def test_full_update_reloads_from_the_folder_and_in_flight_tokens_keep_the_sent_version(standin, tmp_path):
    """A request in flight while the server reloads: vLLM says nothing of versions, so its tokens and their KV
    carry the version it was sent under (the server's is as new or newer)."""
    new = tiny_model("qwen3", seed=5)
    async with serving(standin.app) as url, OpenAIEngine(url, weights_dir=tmp_path, server="vllm") as client:
        running = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_tokens=1500, seed=1)))
        await asyncio.sleep(0.3)
        assert await client.update_weights(new.state_dict()) == 1
        assert not running.done()  # the reload landed mid-request
        assert standin.running.is_set()  # paused for the reload, then resumed
        gen = await running
        assert gen.versions == gen.kv_versions == [0] * 1500
        after = await client.generate(PROMPT, GREEDY)
        assert after.versions == after.kv_versions == [1] * len(after.token_ids)
        torch.testing.assert_close(torch.tensor(after.logprobs), scored(new, PROMPT, after), atol=1e-4, rtol=0)
        assert await client.update_weights(tiny_model("qwen3", seed=6).state_dict()) == 2
    (kept,) = tmp_path.iterdir()  # the loaded one only
    assert kept.name.startswith("agentrl-") and kept.name.endswith("-v2")


async def test_a_failed_reload_resumes_the_server_and_keeps_the_version(standin, tmp_path):
    async with serving(standin.app) as url, OpenAIEngine(url, weights_dir=tmp_path, max_retries=0) as client:
        with pytest.raises(ServerError, match="HTTP 500"):
            await client.update_weights({"no.such.weight": torch.zeros(2)})
        assert standin.running.is_set() and client.version == 0
        assert list(tmp_path.iterdir()) == []  # the failed update's folder is gone
        assert (await client.generate(PROMPT, GREEDY)).versions[0] == 0
        assert await client.update_weights(tiny_model("qwen3", seed=5).state_dict()) == 1  # the next one lands


@pytest.mark.parametrize(
    ("off", "update", "says"),
    [
        ("runtime_lora", "lora", "--enable-lora and the environment VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"),
        ("dev_mode", "full", "VLLM_SERVER_DEV_MODE=1"),
    ],
)
async def test_an_endpoint_the_server_lacks_names_the_setting(model_dir, tmp_path, off, update, says):
    standin = VLLMStandIn(model_dir, **{off: False})
    weights = (
        {"lora": get_peft_model_state_dict(with_lora(tiny_model("qwen3"), LORA))}
        if update == "lora"
        else {"state_dict": tiny_model("qwen3", seed=1).state_dict()}
    )
    policy = EngineModel(str(model_dir), lora=LORA)
    async with serving(standin.app) as url, OpenAIEngine(url, weights_dir=tmp_path, policy=policy) as client:
        with pytest.raises(RequestRejected, match=says):
            await client.update_weights(**weights)
    await standin.close()


async def test_server_kind_and_what_it_takes(standin, tmp_path):
    async with serving(standin.app) as url:
        async with OpenAIEngine(url) as client:  # no weights_dir: only the version moves
            assert client.capabilities.weight_updates == frozenset()
            with pytest.raises(NotImplementedError, match=r"engine\.weights_dir"):
                await client.update_weights(tiny_model("qwen3").state_dict())
            assert await client.update_weights() == 1
        async with OpenAIEngine(url, weights_dir=tmp_path, policy=EngineModel(lora=LORA)) as client:
            assert client.capabilities.weight_updates == {"full", "lora"}
        cfg = EngineConfig(kind="openai", base_url=url, weights_dir=str(tmp_path / "missing"))
        assert "is not a folder" in await asyncio.to_thread(OpenAIEngine.unavailable, cfg)  # checked before a run
        strict = OpenAIEngine(url, server="agentrl")
        with pytest.raises(RuntimeError, match=r"connect\(\)` first"):  # not a guess before the server answered
            _ = strict.capabilities
        with pytest.raises(RequestRejected, match="is not agentrl serve"):
            await strict.connect()
        await strict.close()

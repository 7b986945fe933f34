"""Supervised fine-tuning: conversations laid out as rollouts lay them out, loss on the assistant only."""

import json

import pytest
import torch
from cli import agentrl, sets
from repo_data import write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.env.parsers import HermesParser
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat
from agentrl.train.sft import load_conversations

CONVERSATION = [
    {"role": "system", "content": "You solve tasks."},
    {"role": "user", "content": "Print 1."},
    {"role": "assistant", "content": '<tool_call>\n{"name": "python", "arguments": {"code": "1"}}\n</tool_call>'},
    {"role": "tool", "content": "1"},
    {"role": "assistant", "content": "<answer>1</answer>"},
    {"role": "user", "content": "Thanks."},
]


@pytest.mark.parametrize("template", ["qwen3", "llama3"])
def test_a_conversation_is_laid_out_as_the_template_renders_it(template):
    """The ids are the template's own rendering (no drift at the turn seams; a conversation that ends on a user
    turn, since Qwen3's template renders a final assistant turn with an empty <think> the model never wrote), and
    the loss mask covers exactly each assistant message and the token that closed it."""
    chat = ChatFormat(load_tokenizer(template))
    ids, mask = chat.conversation_ids(CONVERSATION)
    assert chat.tokenizer.decode(ids) == chat.render(CONVERSATION, generation_prompt=True)
    end = chat.tokenizer.decode([chat.turn_end_id])
    trained = chat.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == "".join(m["content"] + end for m in CONVERSATION if m["role"] == "assistant")
    with pytest.raises(ValueError, match="at least one assistant"):
        chat.conversation_ids(CONVERSATION[:2])


def test_an_assistant_message_of_weight_0_is_context_not_a_target():
    """OpenAI's fine-tuning format: `"weight": 0` keeps a message in the conversation and out of the loss; a weight
    other than 0 or 1 is refused, naming the message."""
    chat = ChatFormat(load_tokenizer("qwen3"))
    ids, _ = chat.conversation_ids(CONVERSATION)
    weighted = [*CONVERSATION[:2], CONVERSATION[2] | {"weight": 0}, *CONVERSATION[3:]]
    ids0, mask0 = chat.conversation_ids(weighted)
    assert ids0 == ids
    trained = chat.tokenizer.decode([i for i, m in zip(ids0, mask0, strict=True) if m])
    assert trained == CONVERSATION[4]["content"] + chat.tokenizer.decode([chat.turn_end_id])
    with pytest.raises(ValueError, match=r"message 2: .* weight is 0 or 1, not 0\.5"):
        chat.conversation_ids([*CONVERSATION[:2], CONVERSATION[2] | {"weight": 0.5}, *CONVERSATION[3:]])


def test_a_conversation_with_nothing_to_train_on_is_refused_naming_its_line(tmp_path):
    chat = ChatFormat(load_tokenizer("qwen3"))
    muted = [m | {"weight": 0} if m["role"] == "assistant" else m for m in CONVERSATION]
    write_jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION}, {"messages": muted})
    with pytest.raises(ValueError, match=r"d\.jsonl:2: .*every assistant message has weight 0"):
        load_conversations(tmp_path / "d.jsonl", chat, max_length=4096)


@pytest.mark.slow  # three `agentrl models init` processes
def test_models_init_sets_the_experts_and_their_top_k(tmp_path):
    """The study's volatile-routing policy starts here: 8 experts, top-2, otherwise the default shapes. A top-k
    over the experts in use (those asked for, or the small preset's 8) is refused, writing nothing."""
    agentrl("models", "init", tmp_path / "m8", "--experts", 8, "--top-k", 2, cwd=tmp_path, timeout=600)
    config = json.loads((tmp_path / "m8" / "config.json").read_text())
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["hidden_size"]) == (8, 2, 192)
    for args, experts in ((["--experts", 4, "--top-k", 6], 4), (["--preset", "small", "--top-k", 9], 8)):
        r = agentrl("models", "init", tmp_path / "bad", *args, cwd=tmp_path, timeout=600, check=False)
        assert r.returncode != 0 and f"more experts than the {experts}" in r.stdout + r.stderr
        assert not (tmp_path / "bad").exists()


@pytest.mark.docker
@pytest.mark.slow  # 150 steps; the fast tier records demonstrations in tests/env/test_demos.py and lays them out here
def test_sft_learns_demonstrations_recorded_in_sandboxes(tmp_path):
    """`agentrl envs demos` records real episodes; `agentrl sft` fits a tiny Qwen3-MoE to them; greedy decoding
    of the saved model then writes the demonstrated tool call."""
    agentrl("envs", "demos", "code_sandbox", "-n", 4, "--out", tmp_path / "demos.jsonl", cwd=tmp_path, timeout=600)
    agentrl("models", "init", tmp_path / "init", "--preset", "tiny", cwd=tmp_path, timeout=600)
    r = agentrl(
        "sft",
        "--data",
        tmp_path / "demos.jsonl",
        "--model",
        tmp_path / "init",
        "--out",
        tmp_path / "sft",
        *sets("steps=150", "lr=1e-2", "batch_size=4", "eval_fraction=0", "warmup_steps=5"),
        cwd=tmp_path,
        timeout=600,
    )
    losses = [json.loads(line)["loss"] for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(losses) == 150 and losses[-1] < 0.01 * losses[0], losses[::10]
    tok = AutoTokenizer.from_pretrained(tmp_path / "sft")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sft").eval()
    chat = ChatFormat(tok)
    for line in (tmp_path / "demos.jsonl").read_text().splitlines():
        demo = json.loads(line)
        prompt = chat.prompt_ids(demo["messages"][:2], tools=demo["tools"])
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=200, do_sample=False, eos_token_id=list(chat.stop_token_ids)
            )
        # the demonstrated call: its tool (submit, or run_tests first) is the expert's coin flip; its code the task's
        expected = HermesParser().parse(demo["messages"][2]["content"]).calls[0]
        written = HermesParser().parse(chat.decode(out[0, len(prompt) :].tolist())).calls
        assert written and (written[0].name, written[0].arguments) == (expected.name, expected.arguments)


def test_sft_names_the_bad_line(tmp_path):
    from agentrl.train.sft import load_conversations

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": CONVERSATION[:2]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a chat conversation"):
        load_conversations(bad, ChatFormat(load_tokenizer("qwen3")), 4096)
    latin1 = json.dumps({"messages": CONVERSATION}, ensure_ascii=False).replace("Print", "Prïnt").encode("latin-1")
    bad.write_bytes(json.dumps({"messages": CONVERSATION}).encode() + b"\n" + latin1 + b"\n")  # not UTF-8
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a chat conversation \(UnicodeDecodeError"):
        load_conversations(bad, ChatFormat(load_tokenizer("qwen3")), 4096)


class Interrupted(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path):
    """A run cut off after its step-4 save, run again with resume, ends on the weights of a run never cut off: the
    optimizer's moments, the schedule and the data order came back. Other settings or data are refused, the same data
    under another path is not."""
    from safetensors.torch import load_file

    from agentrl.models.tiny import save_tiny
    from agentrl.train.sft import SFTConfig, sft

    save_tiny(tmp_path / "init", seed=0)
    data = tmp_path / "data.jsonl"
    rows = [[*CONVERSATION[:2], {**CONVERSATION[2], "content": f"<answer>{i}</answer>"}] for i in range(11)]
    write_jsonl(data, *({"messages": r} for r in rows))

    def config(out: str, **changes) -> SFTConfig:
        settings = {
            "data": str(data),
            "out": str(tmp_path / out),
            "model": {"path": str(tmp_path / "init")},
            "steps": 6,
            "batch_size": 4,
            "lr": 1e-2,
            "warmup_steps": 2,
            "eval_fraction": 0.2,
            "eval_every": 2,
            "save_every": 2,
        }
        return SFTConfig.model_validate(settings | changes)

    whole: list[dict] = []
    sft(config("whole"), log=whole.append)

    def crash_after_step_4(m: dict) -> None:
        if m["step"] == 5:
            raise Interrupted

    with pytest.raises(Interrupted):
        sft(config("cut"), log=crash_after_step_4)
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == ["resume-4", "step-2", "step-4"]

    with pytest.raises(ValueError, match=r"resume-4 was saved with other settings \(lr\)"):
        sft(config("cut", lr=2e-2, resume=True), log=lambda m: None)
    write_jsonl(data, *({"messages": r} for r in reversed(rows)))
    with pytest.raises(ValueError, match=r"other settings \(data_sha256\)"):
        sft(config("cut", resume=True), log=lambda m: None)
    # the same demonstrations under another path still resume
    moved = write_jsonl(tmp_path / "elsewhere.jsonl", *({"messages": r} for r in rows))
    resumed: list[dict] = []
    sft(config("cut", resume=True, data=str(moved)), log=resumed.append)
    assert resumed[0] == {"resumed": str(tmp_path / "cut" / "resume-4"), "step": 4}
    assert resumed[1:] == whole[4:]  # steps 5 and 6: the same losses, learning rates and evaluation
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(p.name.startswith("resume-") for p in (tmp_path / "cut").iterdir())  # a finished run needs none


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function"}]},
            r"\['tool_calls'\] would be dropped",
        ),
        ({"role": "assistant", "content": " \n"}, "empty assistant message"),
        ({"role": "assistant", "content": ["<answer>1</answer>"]}, "content is a string"),
        ({"content": "<answer>1</answer>"}, "not an object with a string 'role'"),
    ],
)
def test_an_assistant_message_laid_out_otherwise_than_written_is_refused_naming_its_line(tmp_path, message, error):
    """conversation_ids lays out an assistant message's text content alone: tool calls in another key, an empty
    target (the model taught to end its turn at once) or content in parts would be trained on silently otherwise."""
    chat = ChatFormat(load_tokenizer("qwen3"))
    write_jsonl(tmp_path / "d.jsonl", {"messages": CONVERSATION}, {"messages": [*CONVERSATION[:2], message]})
    with pytest.raises(ValueError, match=rf"d\.jsonl:2: .*message 2: .*{error}"):
        load_conversations(tmp_path / "d.jsonl", chat, max_length=4096)
    # an empty message of weight 0 is context, not a target
    write_jsonl(
        tmp_path / "ok.jsonl",
        {"messages": [*CONVERSATION[:2], {"role": "assistant", "content": "", "weight": 0}, *CONVERSATION[3:]]},
    )
    assert len(load_conversations(tmp_path / "ok.jsonl", chat, max_length=4096)[0]) == 1


def _sft_settings(tmp_path) -> dict:
    from agentrl.models.tiny import save_tiny

    save_tiny(tmp_path / "init", seed=0)
    data = write_jsonl(tmp_path / "d.jsonl", *({"messages": CONVERSATION[:3]} for _ in range(4)))
    return {"data": str(data), "model": {"path": str(tmp_path / "init")}, "batch_size": 2, "eval_fraction": 0}


def test_the_logged_learning_rate_is_the_one_each_step_used(tmp_path):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from agentrl.train.sft import SFTConfig, sft

    settings = _sft_settings(tmp_path) | {"out": str(tmp_path / "out"), "steps": 4, "warmup_steps": 2}
    used: list[float] = []
    hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    try:
        logged: list[dict] = []
        sft(SFTConfig.model_validate(settings), logged.append)
    finally:
        hook.remove()
    assert [m["lr"] for m in logged] == used and used[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])


def test_a_warmup_as_long_as_the_run_is_refused(tmp_path):
    """lr would never be reached, nor decay to min_lr_ratio: 2 epochs of 4 conversations, 2 a step, are 4 steps."""
    from agentrl.train.sft import SFTConfig, sft

    settings = _sft_settings(tmp_path) | {"out": str(tmp_path / "out"), "epochs": 2, "warmup_steps": 4}
    with pytest.raises(ValueError, match=r"warmup_steps=4 is not shorter than the run's 4 optimizer steps \(4 conv"):
        sft(SFTConfig.model_validate(settings))

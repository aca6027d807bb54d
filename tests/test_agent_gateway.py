"""The agent gateway against the session's real SGLang fleet, with the official `openai` and
`anthropic` SDKs, unmodified, as the agent's clients (pointed at the gateway by `base_url`
only): plain, tool and streamed calls are recorded token-in/token-out as `ArealOpenAI`
records them (a turn sent back as the API returned it reuses the earlier call's exact ids), a
closed session's calls export as trajectories, and bad calls are refused in each API's own
error shape, naming the field, key or session at fault."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from prefix_parity import assert_tree_parity
from sglang_helpers import fleet_version, make_controller
from transformers import AutoTokenizer

from areal_like.api import GenerationHyperparameters
from workflows.gateway import AgentGateway

pytestmark = pytest.mark.sglang
CHATML_TURN = "<|im_start|>{role}\n{content}<|im_end|>\n"
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
WAIT_S = 300  # a bound for a hang, not the expected time


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def gateway(sglang_fleet, tokenizer):
    controller = make_controller(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    gw = AgentGateway(controller, tokenizer, GenerationHyperparameters(max_new_tokens=8))
    try:
        controller.run_coroutine(gw.start(), timeout=WAIT_S)
        yield gw, controller
    finally:
        controller.run_coroutine(gw.stop(), timeout=WAIT_S)
        controller.destroy()


def _sdk(base_url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=WAIT_S)


def test_the_openai_sdk_is_recorded_token_in_token_out(gateway, sglang_fleet, tokenizer):
    gw, controller = gateway
    assert gw.host == "127.0.0.1"
    session = gw.open_session()
    sdk = _sdk(gw.session_url(session))
    assert [m.id for m in sdk.models.list()] == ["policy"]

    # 1. plain, with the chosen tokens' log-probabilities
    messages = [{"role": "user", "content": "12 + 30 ="}]
    first = sdk.chat.completions.create(model="policy", messages=messages, max_tokens=8,
                                        temperature=1.0, logprobs=True)
    rec1 = session.client.completions[0]
    assert rec1.id == first.id
    expected = tokenizer.encode(CHATML_TURN.format(role="user", content="12 + 30 =")
                                + "<|im_start|>assistant\n", add_special_tokens=False)
    assert rec1.prompt_ids == expected and first.usage.prompt_tokens == len(expected)
    assert first.choices[0].message.content == tokenizer.decode(rec1.completion_ids,
                                                                skip_special_tokens=True)
    assert [t.logprob for t in first.choices[0].logprobs.content] == pytest.approx(
        rec1.response.output_logprobs, abs=0)
    version = fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    assert set(rec1.response.output_versions) == {version}

    # 2. the next turn, through the session key as the bearer token instead of the URL:
    # its prompt is the first call's exact ids, then only the new text
    bearer = _sdk(f"{gw.url}/v1", api_key=session.key)
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Again?"}]
    second = bearer.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    rec2 = session.client.completions[1]
    assert rec2.id == second.id and rec2.parent is rec1
    head = rec1.prompt_ids + rec1.completion_ids
    assert rec2.prompt_ids[:len(head)] == head

    # 3. tools: offered in the prompt as the model's template renders them; a tool result
    # goes back as the API sends it
    tool_turn = [{"role": "user", "content": "What is 2 + 3?"},
                 {"role": "assistant", "content": "", "tool_calls": [{
                     "id": "call_1", "type": "function",
                     "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    third = sdk.chat.completions.create(model="policy", messages=tool_turn, tools=TOOLS,
                                        max_tokens=8)
    rec3 = session.client.completions[2]
    reference = tokenizer.apply_chat_template(
        [tool_turn[0], {**tool_turn[1], "tool_calls": [{"type": "function", "function": {
            "name": "add", "arguments": {"a": 2, "b": 3}}}]}, tool_turn[2]],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert rec3.prompt_ids == tokenizer.encode(reference, add_special_tokens=False)
    assert third.choices[0].finish_reason in ("stop", "length", "tool_calls")

    # 4. streamed: the chunks carry the recorded reply, then the usage
    chunks = list(sdk.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "7 + 8 ="}], max_tokens=8,
        stream=True, stream_options={"include_usage": True}))
    rec4 = session.client.completions[3]
    assert {c.id for c in chunks} == {rec4.id}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tokenizer.decode(rec4.completion_ids, skip_special_tokens=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(rec4.completion_ids)

    # the closed session's calls are trajectories; a late call is refused, not recorded
    client = controller.run_coroutine(gw.close_session(session.key), timeout=WAIT_S)
    assert client is session.client and len(client.completions) == 4
    for rec, reward in zip(client.completions, (1.0, 0.5, 0.0, 1.0), strict=True):
        client.set_reward(rec.id, reward)
    batch = client.export_batch("individual")
    assert batch["rewards"].tolist() == [1.0, 0.5, 0.0, 1.0]
    first_span = batch["loss_mask"][0].nonzero().flatten()
    torch.testing.assert_close(batch["logprobs"][0, first_span],
                               torch.tensor(rec1.response.output_logprobs), rtol=0, atol=0)
    with pytest.raises(openai.ConflictError, match=f"agent session '{session.key}' ended at"):
        sdk.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    assert len(client.completions) == 4 and gw.sessions.counts["calls_after_close"] == 1


def test_the_anthropic_sdk_is_recorded_token_in_token_out(gateway, tokenizer):
    gw, controller = gateway
    session = gw.open_session()
    sdk = anthropic.Anthropic(base_url=gw.session_root(session), api_key="unused",
                              timeout=WAIT_S)

    # 1. plain, with a system prompt
    messages: list[dict] = [{"role": "user", "content": "12 + 30 ="}]
    first = sdk.messages.create(model="policy", max_tokens=8, system="Add.", messages=messages)
    rec1 = session.client.completions[0]
    expected = tokenizer.encode(CHATML_TURN.format(role="system", content="Add.")
                                + CHATML_TURN.format(role="user", content="12 + 30 =")
                                + "<|im_start|>assistant\n", add_special_tokens=False)
    assert rec1.prompt_ids == expected and first.usage.input_tokens == len(expected)
    text = "".join(b.text for b in first.content if b.type == "text")
    assert text == tokenizer.decode(rec1.completion_ids, skip_special_tokens=True)
    assert first.usage.output_tokens == len(rec1.completion_ids)
    assert first.stop_reason in ("end_turn", "max_tokens")

    # 2. the reply sent back as the API returned it: the next turn extends its exact ids
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": "Again?"}]
    sdk.messages.create(model="policy", max_tokens=8, system="Add.", messages=messages)
    rec2 = session.client.completions[1]
    assert rec2.parent is rec1
    assert rec2.prompt_ids[:len(expected) + len(rec1.completion_ids)] == (
        expected + rec1.completion_ids)

    # 3. tool_use and tool_result blocks are the template's tool call and tool message
    anthropic_tools = [{"name": "add", "description": "Add two integers.",
                        "input_schema": TOOLS[0]["function"]["parameters"]}]
    sdk.messages.create(model="policy", max_tokens=8, tools=anthropic_tools, messages=[
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "add",
                                           "input": {"a": 2, "b": 3}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "5"}]}])
    reference = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "add", "arguments": {"a": 2, "b": 3}}}]},
         {"role": "tool", "tool_call_id": "toolu_1", "content": "5"}],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert session.client.completions[2].prompt_ids == tokenizer.encode(
        reference, add_special_tokens=False)

    # 4. streamed: the SDK assembles the recorded reply from the events
    with sdk.messages.stream(model="policy", max_tokens=8,
                             messages=[{"role": "user", "content": "7 + 8 ="}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    rec4 = session.client.completions[3]
    assert streamed == tokenizer.decode(rec4.completion_ids, skip_special_tokens=True)
    assert final.usage.output_tokens == len(rec4.completion_ids)

    controller.run_coroutine(gw.close_session(session.key), timeout=WAIT_S)
    with pytest.raises(anthropic.ConflictError, match="ended at"):
        sdk.messages.create(model="policy", max_tokens=8, messages=messages)
    with pytest.raises(anthropic.AuthenticationError, match="no agent session 's-nobody'"):
        anthropic.Anthropic(base_url=f"{gw.url}/s/s-nobody", api_key="unused").messages.create(
            model="policy", max_tokens=8, messages=messages)
    with pytest.raises(anthropic.BadRequestError, match="top_k: not supported"):
        anthropic.Anthropic(base_url=gw.url, api_key=gw.open_session().key).messages.create(
            model="policy", max_tokens=8, messages=messages, extra_body={"top_k": 5})


def test_stop_sequences_end_the_text_as_each_api_says(gateway, tokenizer):
    """A reply ended by a `stop` string: OpenAI returns the text before it, Anthropic that
    text with `stop_reason='stop_sequence'` and the string (streamed too); the tokens that
    made it are recorded all the same. The stop string is a word of the greedy reply to the
    same prompt without one."""
    gw, _ = gateway
    session = gw.open_session()
    oa = _sdk(gw.session_url(session))
    an = anthropic.Anthropic(base_url=gw.session_root(session), api_key="unused",
                             timeout=WAIT_S)
    ask = [{"role": "user", "content": "12 + 30 ="}]
    free = oa.chat.completions.create(model="policy", messages=ask, max_tokens=8,
                                      temperature=0).choices[0].message.content
    words = free.split()
    assert len(words) >= 3, free  # (the tiny model's greedy reply to this prompt)
    stop = f" {words[2]}"
    before = free[:free.find(stop)]
    cut = oa.chat.completions.create(model="policy", messages=ask, max_tokens=8,
                                     temperature=0, stop=[stop, "never seen"])
    assert cut.choices[0].message.content == before
    assert cut.choices[0].finish_reason == "stop"
    record = session.client.completions[-1]
    assert record.stop_sequence == stop
    assert before + stop in tokenizer.decode(record.completion_ids, skip_special_tokens=True)
    greedy = {"temperature": 0}  # (this SDK's signature no longer names it)
    reply = an.messages.create(model="policy", max_tokens=8, messages=ask,
                               stop_sequences=[stop], extra_body=greedy)
    assert (reply.content[0].text, reply.stop_reason, reply.stop_sequence) == (
        before, "stop_sequence", stop)
    with an.messages.stream(model="policy", max_tokens=8, messages=ask,
                            stop_sequences=[stop], extra_body=greedy) as stream:
        assert "".join(stream.text_stream) == before
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    plain = an.messages.create(model="policy", max_tokens=8, messages=ask, extra_body=greedy)
    assert plain.stop_sequence is None and plain.stop_reason in ("end_turn", "max_tokens")


def test_claude_codes_request_shapes_are_served(gateway, tokenizer):
    """What Claude Code sends beyond the Messages API's reference: a `system` message among
    the messages (rendered as the template's system turn, where it stands), and `thinking`,
    `output_config`, `context_management`, which are accepted and have no effect."""
    gw, _ = gateway
    session = gw.open_session()
    an = anthropic.Anthropic(base_url=gw.session_root(session), api_key="unused",
                             timeout=WAIT_S)
    reply = an.messages.create(
        model="policy", max_tokens=4, system="You code.",
        messages=[{"role": "user", "content": "hi"},
                  {"role": "system", "content": "<reminder>be brief</reminder>"},
                  {"role": "user", "content": "go"}],
        extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024},
                    "output_config": {"effort": "low"},
                    "context_management": {"edits": []}})
    assert reply.type == "message"
    expected = tokenizer.encode(
        CHATML_TURN.format(role="system", content="You code.")
        + CHATML_TURN.format(role="user", content="hi")
        + CHATML_TURN.format(role="system", content="<reminder>be brief</reminder>")
        + CHATML_TURN.format(role="user", content="go") + "<|im_start|>assistant\n",
        add_special_tokens=False)
    assert session.client.completions[-1].prompt_ids == expected


@pytest.mark.parametrize("body, status, needle", [
    ({"messages": []}, openai.BadRequestError, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, openai.BadRequestError,
     "messages[0].role: 'robot' is not one of"),
    ({"messages": [{"role": "tool", "content": "5"}]}, openai.BadRequestError,
     "messages[0]: a tool message needs its 'tool_call_id'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     openai.BadRequestError, "messages[0].content[0]: only text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, openai.BadRequestError,
     "n=2: one choice per request"),
    ({"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 0.5},
     openai.BadRequestError, "frequency_penalty=0.5"),
])
def test_a_malformed_request_is_refused_naming_its_field(gateway, body, status, needle):
    gw, _ = gateway
    session = gw.open_session()
    before = gw.sessions.counts["bad_requests"]
    with pytest.raises(status) as refused:
        _sdk(gw.session_url(session)).chat.completions.create(model="policy", **body)
    assert needle in str(refused.value) and refused.value.status_code == 400
    assert gw.sessions.counts["bad_requests"] == before + 1
    assert session.client.completions == []  # nothing was generated or recorded


def test_the_door_names_unknown_keys_paths_and_bodies_past_the_limit(gateway):
    """An unknown or missing session key is 401 (models included), a path the gateway does
    not serve 404, a body past its limit 413, messages with more characters than the context
    could hold as tokens 400: each in the API's JSON error shape, not retried; the gateway
    serves the next call."""
    import urllib.error
    import urllib.request

    gw, _ = gateway
    with pytest.raises(openai.AuthenticationError, match="no agent session 's-nobody'"):
        _sdk(f"{gw.url}/s/s-nobody/v1").chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError, match="no agent session"):
        _sdk(f"{gw.url}/v1", api_key="s-nobody").models.list()
    session = gw.open_session()

    def refused(path: str, data: bytes) -> tuple[int, dict, str]:
        request = urllib.request.Request(f"{gw.session_root(session)}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=WAIT_S)
        return e.value.code, json.loads(e.value.read()), e.value.headers["x-should-retry"]

    code, body, retry = refused("/v1/embeddings", b"{}")
    assert (code, body["error"]["type"], retry) == (404, "not_found_error", "false")
    big = json.dumps({"model": "policy", "messages": [
        {"role": "user", "content": "x" * (gw.max_body_bytes + 1)}]}).encode()
    for path, shape in (("/v1/chat/completions", lambda b: b["error"]["message"]),
                        ("/v1/messages", lambda b: b["error"]["message"])):
        code, body, retry = refused(path, big)
        assert code == 413 and retry == "false", body
        assert f"over this gateway's limit of {gw.max_body_bytes} bytes" in shape(body)
    # under the body limit, but more characters than the context can hold in tokens (the
    # longest token times the 1024 positions): refused before the tokenizer sees it
    assert gw.max_prompt_chars == 1024 * gw.token_chars
    long = json.dumps({"model": "policy", "max_tokens": 4, "messages": [
        {"role": "user", "content": "7" * (gw.max_prompt_chars + 1)}]}).encode()
    assert len(long) < gw.max_body_bytes
    for path in ("/v1/chat/completions", "/v1/messages"):
        code, body, retry = refused(path, long)
        assert code == 400 and retry == "false", body
        message = body["error"]["message"]  # (the role's characters count too)
        assert re.search(r"hold 133\d\d characters: at least 1024 tokens .* past the "
                         r"model's context of 1024 positions", message), message
    ok = _sdk(gw.session_url(session)).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_a_failed_follow_up_keeps_the_answered_turn(gateway):
    """A call that continues an answered one and fails (here: a prompt past the served
    context) leaves the answered call a conversation of its own in the export."""
    gw, controller = gateway
    session = gw.open_session()
    sdk = _sdk(gw.session_url(session))
    messages = [{"role": "user", "content": "1 + 1 ="}]
    first = sdk.chat.completions.create(model="policy", messages=messages, max_tokens=4)
    too_long = [*messages, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": " ".join(["12 + 30"] * 2000)}]
    with pytest.raises(openai.APIStatusError):
        sdk.chat.completions.create(model="policy", messages=too_long, max_tokens=4)
    client = controller.run_coroutine(gw.close_session(session.key), timeout=WAIT_S)
    assert len(client.completions) == 1 and not client.completions[0].extended
    client.set_final_reward(1.0)
    assert client.export_batch("concat")["rewards"].tolist() == [1.0]


@pytest.mark.parametrize("extra, needle", [
    ({"messages": [{"role": "robot", "content": "hi"}]},
     "messages[0].role: 'robot' is not one of user, assistant, system"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]: only text, tool_use and tool_result blocks"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "5"}]}]},
     "a tool_result needs its 'tool_use_id'"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}},
     "tool_choice.type='any': the policy chooses"),
])
def test_a_malformed_anthropic_request_is_refused_naming_its_field(gateway, extra, needle):
    gw, _ = gateway
    session = gw.open_session()
    with pytest.raises(anthropic.BadRequestError) as refused:
        anthropic.Anthropic(base_url=gw.session_root(session), api_key="unused").messages.create(
            model="policy", max_tokens=8, **extra)
    assert needle in str(refused.value)
    assert session.client.completions == []


# ---- agent programs as workflows (workflows/program.py) -------------------------------------
PYTHON_AGENT = '''
import json, os
from openai import OpenAI

item = json.loads(os.environ["AREAL_LIKE_ITEM"])
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY: the gateway session's
messages = [{"role": "user", "content": item["question"]}]
reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
messages += [reply.choices[0].message.model_dump(exclude_none=True),
             {"role": "user", "content": "Sure?"}]
second = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
with open("answer.txt", "w") as f:
    f.write(second.choices[0].message.content)
print("done")
'''
# a program in another language: a shell command speaking the Anthropic API through curl
SHELL_AGENT = ('curl -sf "$ANTHROPIC_BASE_URL/v1/messages" -H "x-api-key: $ANTHROPIC_API_KEY" '
               '-H "content-type: application/json" -d \'{"model": "policy", "max_tokens": 4, '
               '"messages": [{"role": "user", "content": "1 + 1 ="}]}\' > reply.json')


def _episode(controller, workflow, item: dict):
    return controller.run_coroutine(workflow.arun_episode(controller, item), timeout=WAIT_S)


def test_unmodified_agent_programs_are_episodes(gateway, sglang_fleet, tmp_path, tokenizer,
                                                tiny_model_dir):
    import sys

    from workflows.program import ProgramWorkflow

    _, controller = gateway
    script = tmp_path / "agent.py"
    script.write_text(PYTHON_AGENT)
    rewarded = []

    def verifier(item, run):  # the reward: the program's own output and files
        assert run.exit_code == 0 and run.stdout == "done\n" and run.n_calls == 2
        rewarded.append((run, float(len(run.read("answer.txt")) + item["id"])))
        return rewarded[-1][1]

    gconfig = GenerationHyperparameters(max_new_tokens=6, n_samples=2)
    python_agent = ProgramWorkflow([sys.executable, str(script)], verifier, gconfig, tokenizer,
                                   timeout_s=WAIT_S)
    shell_agent = ProgramWorkflow(SHELL_AGENT, lambda item, run: float(
        json.loads(run.read("reply.json"))["type"] == "message"),
        gconfig.new(n_samples=1), tokenizer, timeout_s=WAIT_S)
    try:
        batch = _episode(controller, python_agent, {"id": 3, "question": "12 + 30 ="})
        shell = _episode(controller, shell_agent, {"id": 4})
    finally:
        for workflow in (python_agent, shell_agent):
            controller.run_coroutine(workflow.aclose(), timeout=WAIT_S)
    # one row per conversation (the second call extends the first: both turns trained),
    # rewarded by the verifier, one group
    assert sorted(batch["rewards"].tolist()) == sorted(reward for _, reward in rewarded)
    assert len(rewarded) == 2
    assert batch["group_id"].unique().numel() == 1
    version = fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    trained = batch["loss_mask"].bool()
    assert set(batch["versions"][trained].tolist()) == {version}
    assert torch.isfinite(batch["logprobs"][trained]).all()
    # the two conversations (the prompt shared, then each its own turns) through the
    # trainer's prefix tree: what the packed whole computes
    tokens, rows = assert_tree_parity(tiny_model_dir, batch)
    assert rows < tokens
    assert shell["rewards"].tolist() == [1.0]
    assert python_agent.gateway is None  # closed; no session left open
    assert not rewarded[0][0].work_dir.exists()  # each run's work directory is removed


@pytest.mark.parametrize("command, verifier, timeout_s, needle", [
    ("echo boom >&2; exit 3", None, WAIT_S, "exited with code 3; the end of its stderr:\nboom"),
    ("sleep 31.25", None, 1.0, "still ran after timeout_s=1 s: its process group was killed"),
    ("exit 0", None, WAIT_S, "made no model call"),
])
def test_a_failed_program_fails_its_episode_with_the_reason(gateway, tokenizer, command,
                                                           verifier, timeout_s, needle):
    from workflows.program import ProgramError, ProgramWorkflow

    _, controller = gateway
    workflow = ProgramWorkflow(command, verifier or (lambda item, run: 1.0),
                               GenerationHyperparameters(max_new_tokens=4), tokenizer,
                               timeout_s=timeout_s)
    try:
        with pytest.raises(ProgramError, match=re.escape(needle)):
            _episode(controller, workflow, {"id": 1})
    finally:
        controller.run_coroutine(workflow.aclose(), timeout=WAIT_S)
    leftovers = [p for p in Path("/proc").glob("[0-9]*/cmdline")
                 if b"sleep\x0031.25" in _read_bytes(p)]
    assert not leftovers  # the timed-out program's process group is gone


def test_a_verifier_without_a_number_and_a_missing_program_are_refused(gateway, tokenizer,
                                                                      tmp_path):
    import sys

    from workflows.program import ProgramError, ProgramWorkflow

    _, controller = gateway
    script = tmp_path / "agent.py"
    script.write_text(PYTHON_AGENT)
    gconfig = GenerationHyperparameters(max_new_tokens=4)
    workflow = ProgramWorkflow([sys.executable, str(script)], lambda item, run: None, gconfig,
                               tokenizer, timeout_s=WAIT_S)
    try:
        with pytest.raises(ProgramError, match="the verifier gave None"):
            _episode(controller, workflow, {"id": 1, "question": "1 + 1 ="})
    finally:
        controller.run_coroutine(workflow.aclose(), timeout=WAIT_S)
    with pytest.raises(ValueError, match="program 'no-such-agent' not found"):
        ProgramWorkflow(["no-such-agent"], lambda item, run: 1.0, gconfig, tokenizer)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _gateway_calls(key: str) -> Any:
    """(path, body) of hostile calls to one session: Chat Completions and Messages bodies as
    the SDKs send them with a field or two left out or given any hostile value, or noise."""
    from door_fuzz import JSON_VALUES, bodies, json_bytes, near, raw_bodies
    from hypothesis import strategies as st

    text = st.text(max_size=20) | st.sampled_from(["12 + 30 =", "", "☃" * 30])
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                     min_size=1, max_size=2)
    user = st.fixed_dictionaries({"role": st.just("user"), "content": text | parts})
    turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                  "content": text | parts})
    conversation = st.builds(lambda first, rest: [first, *rest], user,
                             st.lists(turn, max_size=2))
    required = {"model": st.just("policy"), "messages": conversation,
                "max_tokens": st.integers(1, 4)}
    optional = {"temperature": st.floats(0, 2), "stream": st.booleans()}
    chat = {**optional, "tools": st.just(TOOLS), "stop": st.lists(text, max_size=2),
            "logprobs": st.booleans(), "tool_choice": st.sampled_from(["auto", "none"])}
    messages = {**optional, "system": text | parts, "stop_sequences": st.lists(text, max_size=2),
                "thinking": st.fixed_dictionaries({"type": st.just("enabled"),
                                                   "budget_tokens": st.integers(0, 2048)})}
    chat["max_completion_tokens"] = st.sampled_from([0, -1, 2, 10**9])
    root = f"/s/{key}/v1"
    json_calls = st.one_of(
        st.tuples(st.just(f"{root}/chat/completions"),
                  near(required, chat) | bodies({**required, **chat})),
        st.tuples(st.just(f"{root}/messages"),
                  near(required, messages) | bodies({**required, **messages})),
    ).map(lambda call: (call[0], json_bytes(call[1])))
    noise = st.tuples(st.sampled_from([f"{root}/chat/completions", f"{root}/messages",
                                       f"{root}/models", f"{root}/responses"]), raw_bodies())
    return st.one_of(json_calls, json_calls, json_calls, noise, st.tuples(
        st.sampled_from([f"{root}/chat/completions", "/v1/messages"]),
        JSON_VALUES.map(json_bytes)))


def test_hostile_calls_are_refused_in_the_apis_shape_and_reach_no_other_session(gateway):
    """A standing test of the door (hypothesis, derandomized, 150 calls on one session):
    every reply is 2xx or a 4xx whose JSON says why under `error.message` (both APIs' shape),
    never a 5xx or a dropped connection; afterwards another session's calls are served and
    recorded as before, and none of the hostile session's calls is in its record."""
    from door_fuzz import FUZZ_SETTINGS, assert_refused_or_served, send
    from hypothesis import given

    gw, controller = gateway
    bystander = gw.open_session()
    sdk = _sdk(gw.session_url(bystander))
    sdk.chat.completions.create(model="policy", messages=[{"role": "user", "content": "1 + 1 ="}],
                                max_tokens=2)
    hostile = gw.open_session()
    seen: dict[str, int] = {}

    @FUZZ_SETTINGS
    @given(call=_gateway_calls(hostile.key))
    def one(call: tuple[str, bytes]) -> None:
        path, data = call
        reply = send("POST", gw.url + path, data, {"Content-Type": "application/json"})
        assert_refused_or_served(reply, f"POST {path} {data[:300]!r}", "error.message")
        kind = f"{reply.status // 100}xx"
        seen[kind] = seen.get(kind, 0) + 1

    one()
    print(f"hostile calls: {seen}")
    assert seen.get("4xx", 0) >= 20 and seen.get("2xx", 0) >= 10, seen  # both kinds reached
    after = sdk.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "2 + 2 ="}], max_tokens=2)
    assert after.choices[0].message.content is not None
    record = controller.run_coroutine(gw.close_session(bystander.key), timeout=WAIT_S)
    assert [c.id for c in record.completions][-1] == after.id and len(record.completions) == 2

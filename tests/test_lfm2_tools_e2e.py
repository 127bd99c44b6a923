"""LFM2's and LFM2.5's tool formats end to end, on both engines, through a real server and the official client.

Four servers, one at a time (one module-scoped fixture parametrized by engine and member: pytest ends one before
it starts the next, so vLLM starts twice and never runs twice at once): llama.cpp over a tiny LFM2 GGUF
(tests/tiny_lfm2.py, LFM2's special tokens at LFM2's ids) and vLLM over the tiny LFM2 repository (tests/hf_repos.py,
SmolLM2's tokenizer, so the markers are plain text there), each once with LFM2's chat template and once with an
LFM2.5-style one (`LFM25_TEMPLATE`), written into the model. Both templates must be read as the `lfm2` call
format; the LFM2.5 one puts the tools in the system turn as `List of tools: [JSON]` without list tokens and a tool
result in a plain `tool` turn. It also cuts `</think>` out of earlier turns, yet it is no thinking template: taken
for one, a forced call was run after a thinking phase that a model which does not think never closes
(`finish_reason` "length", no call).

The weights are random, so the calls are forced (`tool_choice` "required" or a named function: the grammar lets
the model write only a valid call in the detected format) and the tools take only enum and boolean arguments, which
a random model finishes in a few tokens. The rendered prompt is read back through POST /tokenize (vLLM's `messages`
form renders the chat with the model's template) and POST /detokenize.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.hf_repos import tiny_lfm2_repo
from tests.test_server import Server
from tests.tiny_lfm2 import LFM2_TEMPLATE, write_tiny_lfm2

LFM25_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- set keep_past_thinking = keep_past_thinking | default(false) -%}\n"
    '{%- set ns = namespace(system_prompt="", last_assistant=-1) -%}\n'
    '{%- if messages[0]["role"] == "system" -%}\n'
    '    {%- set ns.system_prompt = messages[0]["content"] -%}\n'
    "    {%- set messages = messages[1:] -%}\n"
    "{%- endif -%}\n"
    "{%- if tools -%}\n"
    '    {%- set ns.system_prompt = ns.system_prompt + ("\\n" if ns.system_prompt else "") + "List of tools: [" -%}\n'
    "    {%- for tool in tools -%}\n"
    "        {%- if tool is not string -%}\n"
    "            {%- set tool = tool | tojson -%}\n"
    "        {%- endif -%}\n"
    "        {%- set ns.system_prompt = ns.system_prompt + tool -%}\n"
    "        {%- if not loop.last -%}\n"
    '            {%- set ns.system_prompt = ns.system_prompt + ", " -%}\n'
    "        {%- endif -%}\n"
    "    {%- endfor -%}\n"
    '    {%- set ns.system_prompt = ns.system_prompt + "]" -%}\n'
    "{%- endif -%}\n"
    "{%- if ns.system_prompt -%}\n"
    '    {{- "<|im_start|>system\\n" + ns.system_prompt + "<|im_end|>\\n" -}}\n'
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    '    {%- if message["role"] == "assistant" -%}\n'
    "        {%- set ns.last_assistant = loop.index0 -%}\n"
    "    {%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- for message in messages -%}\n"
    '    {{- "<|im_start|>" + message["role"] + "\\n" -}}\n'
    '    {%- set content = message["content"] -%}\n'
    "    {%- if content is not string -%}\n"
    "        {%- set content = content | tojson -%}\n"
    "    {%- endif -%}\n"
    '    {%- if message["role"] == "assistant" and not keep_past_thinking and loop.index0 != ns.last_assistant -%}\n'
    '        {%- if "</think>" in content -%}\n'
    '            {%- set content = content.split("</think>")[-1] | trim -%}\n'
    "        {%- endif -%}\n"
    "    {%- endif -%}\n"
    '    {{- content + "<|im_end|>\\n" -}}\n'
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    '    {{- "<|im_start|>assistant\\n" -}}\n'
    "{%- endif -%}\n"
)
"""An LFM2.5-style chat template (as the LFM2.5 models ship it): the tools in the system turn as `List of tools:
[{…}, {…}]` with no list tokens, a tool result as the plain content of a `tool` turn (no response tokens), and
the thinking of all but the last assistant turn dropped."""

_RENDER_CALLS = (
    "    {%- if message.get(\"tool_calls\") -%}\n"
    "        {%- set calls = namespace(texts=[]) -%}\n"
    "        {%- for tool_call in message[\"tool_calls\"] -%}\n"
    "            {%- set args = namespace(texts=[]) -%}\n"
    "            {%- for name, value in tool_call[\"function\"][\"arguments\"].items() -%}\n"
    "                {%- if value is none -%}{%- set text = \"null\" -%}\n"
    "                {%- elif value is boolean -%}{%- set text = \"True\" if value else \"False\" -%}\n"
    "                {%- elif value is string -%}{%- set text = '\"' ~ value ~ '\"' -%}\n"
    "                {%- elif value is mapping or value is iterable -%}{%- set text = value | tojson -%}\n"
    "                {%- else -%}{%- set text = value | string -%}\n"
    "                {%- endif -%}\n"
    "                {%- set args.texts = args.texts + [name ~ \"=\" ~ text] -%}\n"
    "            {%- endfor -%}\n"
    "            {%- set call = tool_call[\"function\"][\"name\"] ~ \"(\" ~ (args.texts | join(\", \")) ~ \")\" -%}\n"
    "            {%- set calls.texts = calls.texts + [call] -%}\n"
    "        {%- endfor -%}\n"
    "        {{- \"<|tool_call_start|>[\" + (calls.texts | join(\", \")) + \"]<|tool_call_end|>\" -}}\n"
    "    {%- endif -%}\n"
)
LFM25_CALLS_TEMPLATE = LFM25_TEMPLATE.replace(
    '    {{- "<|im_start|>" + message["role"] + "\\n" -}}\n',
    '    {{- "<|im_start|>" + message["role"] + "\\n" -}}\n' + _RENDER_CALLS,
)
"""The later LFM2.5 template: the same, but it writes an assistant turn's `tool_calls` itself, as
`<|tool_call_start|>[f(a="x", b=True)]<|tool_call_end|>` before the turn's content (lmserve must not add them again)."""

TEMPLATES = {"lfm2": LFM2_TEMPLATE, "lfm25": LFM25_TEMPLATE, "lfm25calls": LFM25_CALLS_TEMPLATE}

UNIT: dict[str, Any] = {
    "type": "function",
    "function": {"name": "set_unit", "description": "Set the temperature unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["unit"],
        "additionalProperties": False}},
}
LIGHTS: dict[str, Any] = {
    "type": "function",
    "function": {"name": "switch_lights", "description": "Switch a room's lights", "parameters": {
        "type": "object",
        "properties": {"room": {"enum": ["kitchen", "hall"]}, "on": {"type": "boolean"}},
        "required": ["room", "on"], "additionalProperties": False}},
}
TOOLS = [UNIT, LIGHTS]
ASK = [{"role": "user", "content": "Use celsius, please."}]
RESULT = "the hall lights are on"
FOLLOW_UP = [  # the call's null content must render as "", never as the text `null`
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "switch_lights", "arguments": '{"room": "hall", "on": true}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
]


@dataclass
class Served:
    """One server of one LFM2 member on one engine."""

    engine: str
    member: str
    server: Server
    model: str

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = httpx.post(self.server.base_url + path, json={"model": self.model, **body}, timeout=120)
        assert reply.status_code == 200, reply.text
        answer: dict[str, Any] = reply.json()
        return answer

    def rendered(self, messages: list[dict[str, Any]]) -> tuple[str, int]:
        """The chat as the server renders it with its template (and the tools), and its number of tokens."""
        tokens = self.post("/tokenize", {"messages": messages, "tools": TOOLS})["tokens"]
        return self.post("/detokenize", {"tokens": tokens})["content"], len(tokens)


def _gguf(tmp: Path, member: str) -> Path:
    return write_tiny_lfm2(tmp / f"tiny-{member}.gguf", chat_template=TEMPLATES[member], name=f"tiny-{member}")


def _repository(tmp: Path, member: str) -> Path:
    """A copy of the tiny LFM2 repository whose chat template is the member's (in both places transformers reads)."""
    repo = Path(shutil.copytree(tiny_lfm2_repo(), tmp / f"tiny-{member}"))
    (repo / "chat_template.jinja").write_text(TEMPLATES[member])
    config = json.loads((repo / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATES[member]
    (repo / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return repo


@pytest.fixture(scope="module", params=["llamacpp-lfm2", "llamacpp-lfm25", "llamacpp-lfm25calls",
                                               "vllm-lfm2", "vllm-lfm25"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    engine, member = str(request.param).split("-")
    tmp = tmp_path_factory.mktemp(str(request.param))
    if engine == "llamacpp":
        server = Server("-m", str(_gguf(tmp, member)), "-np", "2", "-c", "1024")
        [model] = [m["name"] for m in httpx.get(server.base_url + "/api/ps").json()["models"]]
    else:
        server = Server(str(_repository(tmp, member)), "--dtype", "float32", "-np", "2", "-c", "1024")
        model = server.repository_model()
    yield Served(engine, member, server, model)
    server.stop()


@pytest.fixture
def client(served: Served) -> Iterator[openai.OpenAI]:
    with served.server.client() as c:
        yield c


def check_call(call: Any, tool: dict[str, Any] | None = None) -> None:
    """A well-formed call of `tool` (or of one of TOOLS) with arguments that are JSON valid for its schema."""
    [spec] = [t for t in ([tool] if tool else TOOLS) if t["function"]["name"] == call.function.name]
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])


def test_the_template_renders_the_tools_where_the_member_puts_them(served: Served) -> None:
    text, _ = served.rendered(ASK)
    listed = ", ".join(json.dumps(tool, ensure_ascii=False) for tool in TOOLS)
    assert "<|im_start|>system\n" in text
    if served.member == "lfm2":
        assert f"List of tools: <|tool_list_start|>[{listed}]<|tool_list_end|><|im_end|>" in text
    else:
        assert f"List of tools: [{listed}]<|im_end|>" in text
        assert "<|tool_list_start|>" not in text and "<|tool_list_end|>" not in text
    assert text.endswith("<|im_start|>user\nUse celsius, please.<|im_end|>\n<|im_start|>assistant\n")
    capabilities = httpx.post(served.server.base_url + "/api/show", json={"model": served.model}).json()
    assert "tools" in capabilities["capabilities"] and "thinking" not in capabilities["capabilities"]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_comes_back_as_tool_calls(served: Served, client: openai.OpenAI, choice: str) -> None:
    tool_choice: Any = "required" if choice == "required" else {"type": "function",
                                                               "function": {"name": "switch_lights"}}
    reply = client.chat.completions.create(model=served.model, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                           tool_choice=tool_choice, temperature=0, max_tokens=120, logprobs=True)
    [result] = reply.choices
    assert result.finish_reason == "tool_calls"
    assert not result.message.content
    [call] = result.message.tool_calls or []
    check_call(call, LIGHTS if choice == "named" else None)
    # The model wrote the call in LFM2's own format (the grammar of the detected `lfm2` parser), not lmserve's JSON.
    written = "".join(token.token for token in (result.logprobs.content if result.logprobs else None) or [])
    start, end = "<|tool_call_start|>", "<|tool_call_end|>"
    assert written.startswith(start) and written.endswith(end), written
    assert json.loads(written[len(start):-len(end)]) == [
        {"name": call.function.name, "arguments": json.loads(call.function.arguments)}]
    _, prompt_tokens = served.rendered(ASK)
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens


def test_a_streamed_forced_call_arrives_in_deltas(served: Served, client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=served.model, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                            tool_choice="required", temperature=0, max_tokens=120, stream=True)
    content, finish = "", None
    calls: dict[int, dict[str, str]] = {}
    for chunk in stream:
        for delta_choice in chunk.choices:
            content += delta_choice.delta.content or ""
            finish = delta_choice.finish_reason or finish
            for delta in delta_choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function.name or "") if delta.function else ""
                call["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert finish == "tool_calls" and not content
    [call] = calls.values()
    [spec] = [t for t in TOOLS if t["function"]["name"] == call["name"]]
    assert call["id"]
    jsonschema.validate(json.loads(call["arguments"]), spec["function"]["parameters"])


def test_a_tool_result_renders_where_the_member_puts_it_and_the_turn_goes_on(
    served: Served, client: openai.OpenAI
) -> None:
    text, prompt_tokens = served.rendered(FOLLOW_UP)
    result = f"<|tool_response_start|>{RESULT}<|tool_response_end|>" if served.member == "lfm2" else RESULT
    assert text.endswith(
        "<|im_start|>assistant\n<|tool_call_start|>[switch_lights(room=\"hall\", on=True)]<|tool_call_end|><|im_end|>\n"
        f"<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
    ), text
    assert "null" not in text  # the call's null content is "", not the text `null`
    reply = client.chat.completions.create(model=served.model, messages=FOLLOW_UP, tools=TOOLS,  # type: ignore[arg-type]
                                           temperature=0, max_tokens=8)
    assert reply.choices[0].finish_reason in {"stop", "length", "tool_calls"}
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens

"""The tools of a Responses request (lmserve/dialects/responses/tools.py), in-process over the fake engine and through
the official `openai` client in strict mode where it can send the request: tool types lmserve does not run are left
out and named in a header, namespace tools are expanded and their calls come back with the namespace, and tool
choices that force what lmserve does not run are 400s naming it."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from api_wire import assert_openai_error
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from lmserve.chat.template import ChatTemplate
from lmserve.config import ServerConfig
from lmserve.dialects.responses import schemas as wire
from lmserve.dialects.responses.tools import IGNORED_TOOLS_HEADER, chat_tools, ignored_header, offered_tools
from lmserve.engine.slots.batching import BatchingEngine
from lmserve.engine.slots.fake import FakeBackend
from lmserve.errors import InvalidRequest
from lmserve.http.app import create_app
from lmserve.service import static_service
from lmserve.service.residency import LoadedModel
from lmserve.types import SamplingParams
from tests.codex_request import EXEC_COMMAND, MULTI_AGENT, SPAWN_AGENT, WEB_SEARCH, codex_request

TEMPLATE = (  # hermes-style (<tool_call>): shows each tool's name and description, and each call's name
    "{% for t in tools or [] %}<tool>{{ t.function.name }}: {{ t.function.description }}</tool>\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPAWN = '<tool_call>{"name": "spawn_agent", "arguments": {"message": "look"}}</tool_call>'
EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
TOOL_TYPES_NOT_RUN: list[dict[str, Any]] = [  # every non-function member of the spec's `Tool` union, and one it lacks
    {"type": "web_search", "external_web_access": False}, {"type": "web_search_2025_08_26"},
    {"type": "web_search_preview"}, {"type": "web_search_preview_2025_03_11"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "linux"},
    {"type": "computer"}, {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp"},
    {"type": "code_interpreter", "container": {"type": "auto"}}, {"type": "image_generation"},
    {"type": "local_shell"}, {"type": "shell"}, {"type": "apply_patch"}, {"type": "custom", "name": "patch"},
    {"type": "tool_search"}, {"type": "programmatic_tool_calling"}, {"type": "a_tool_of_2027", "x": 1},
]


class RecordingBackend(FakeBackend):
    """The fake backend, keeping each prompt it is given as text (its tokens are the prompt's bytes)."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(**fields)
        self.prompts: list[str] = []

    def start(self, slot: int, sampling: SamplingParams, prompt: list[int], num_reused: int,
              generated: list[int] | None = None) -> int:
        self.prompts.append(bytes(prompt).decode())
        return super().start(slot, sampling, prompt, num_reused, generated)


@pytest.fixture
def backend() -> RecordingBackend:
    return RecordingBackend(script=SPAWN)


@pytest.fixture
async def http(tmp_path: Path, backend: RecordingBackend) -> AsyncIterator[httpx.AsyncClient]:
    engine = BatchingEngine(backend)
    model = LoadedModel(name="fake", engine=engine, template=ChatTemplate(TEMPLATE), template_source=TEMPLATE)
    app = create_app(static_service([model]), ServerConfig(models_dir=str(tmp_path)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        yield client
    engine.close()


@pytest.fixture
def client(http: httpx.AsyncClient) -> Iterator[openai.AsyncOpenAI]:
    yield openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0,
                             _strict_response_validation=True)


def events_of(text: str) -> list[dict[str, Any]]:
    events = [json.loads(block.split("\n")[1].removeprefix("data: ")) for block in text[:-2].split("\n\n")]
    for event in events:
        EVENTS.validate_python(event)
    return events


# ---- tools lmserve does not run -----------------------------------------------------------------------------


@pytest.mark.parametrize("tool", TOOL_TYPES_NOT_RUN, ids=lambda tool: tool["type"])
async def test_a_tool_lmserve_does_not_run_is_left_out_and_named(http: httpx.AsyncClient, backend: RecordingBackend,
                                                                 tool: dict[str, Any],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": "fake", "input": "Hi", "tools": [EXEC_COMMAND, tool]}
    with caplog.at_level(logging.WARNING, logger="lmserve.dialects.responses.routes"):
        reply = await http.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.headers[IGNORED_TOOLS_HEADER] == tool["type"]
    assert tool["type"] in caplog.text
    assert "<tool>exec_command:" in backend.prompts[-1] and tool["type"] not in backend.prompts[-1]
    assert reply.json()["tools"] == [EXEC_COMMAND, tool]  # echoed as sent


async def test_the_openai_client_gets_the_header_whole_and_streamed(client: openai.AsyncOpenAI) -> None:
    tools: Any = [EXEC_COMMAND, WEB_SEARCH, {"type": "file_search", "vector_store_ids": ["vs_1"]},
                  {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp"},
                  {"type": "web_search"}]
    raw = await client.responses.with_raw_response.create(model="fake", input="Hi", tools=tools)
    assert raw.headers[IGNORED_TOOLS_HEADER] == "web_search, file_search, mcp"
    response = raw.parse()
    assert [tool.type for tool in response.tools] == ["function", "web_search", "file_search", "mcp", "web_search"]
    async with client.responses.with_streaming_response.create(model="fake", input="Hi", tools=tools,
                                                               stream=True) as streamed:
        assert streamed.headers[IGNORED_TOOLS_HEADER] == "web_search, file_search, mcp"
        assert streamed.headers["cache-control"] == "no-cache"
        assert "response.completed" in await streamed.text()


async def test_no_header_when_every_tool_runs(http: httpx.AsyncClient) -> None:
    reply = await http.post("/v1/responses", json={"model": "fake", "input": "Hi", "tools": [EXEC_COMMAND]})
    assert reply.status_code == 200 and IGNORED_TOOLS_HEADER not in reply.headers


@pytest.mark.parametrize(("choice", "tools", "words"), [
    ({"type": "web_search_preview"}, [EXEC_COMMAND, {"type": "web_search_preview"}], "'web_search_preview' tool"),
    ({"type": "file_search"}, [EXEC_COMMAND], "'file_search' tool"),
    ({"type": "image_generation"}, [{"type": "image_generation"}], "'image_generation' tool"),
    ({"type": "mcp", "server_label": "deepwiki"}, [EXEC_COMMAND], "'mcp' tool 'deepwiki'"),
    ({"type": "custom", "name": "patch"}, [{"type": "custom", "name": "patch"}], "'custom' tool 'patch'"),
    ({"type": "shell"}, [{"type": "shell"}], "'shell' tool"),
    ({"type": "apply_patch"}, [EXEC_COMMAND], "'apply_patch' tool"),
    ({"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "exec_command"},
                                                         {"type": "web_search"}]}, [EXEC_COMMAND], "'web_search'"),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "nope"}]}, [EXEC_COMMAND],
     "'nope', which is not among the tools"),
    ({"type": "function", "name": "web_search"}, [EXEC_COMMAND, WEB_SEARCH], "'web_search', which is not among"),
    ("required", [WEB_SEARCH], "requires tools that lmserve runs (left out: web_search)"),
])
async def test_a_choice_that_forces_a_tool_lmserve_does_not_run_is_a_400(http: httpx.AsyncClient, choice: Any,
                                                                         tools: list[Any], words: str) -> None:
    reply = await http.post("/v1/responses", json={"model": "fake", "input": "Hi", "tools": tools,
                                                   "tool_choice": choice})
    assert reply.status_code == 400, reply.text
    error = assert_openai_error(reply.json(), error_type="invalid_request_error")
    assert error["param"] == "tool_choice" and words in error["message"], error["message"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "name": ""}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "nope"}]}, "tools"),
    ({"tools": [{"type": ""}]}, "tools"),
    ({"tools": [{"type": {"nested": 1}}]}, "tools"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": []}]}, "tools"),
    ({"tools": [{"type": "namespace", "tools": [EXEC_COMMAND]}]}, "tools"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function"}]}]}, "tools"),
    ({"tools": [EXEC_COMMAND], "tool_choice": "web_search"}, "tool_choice"),
    ({"tools": [EXEC_COMMAND], "tool_choice": {"type": 3}}, "tool_choice"),
    ({"tools": [EXEC_COMMAND], "tool_choice": {"type": "allowed_tools", "mode": "sometimes", "tools": []}},
     "tool_choice"),
])
async def test_malformed_tools_and_choices_are_400s(http: httpx.AsyncClient, fields: dict[str, Any],
                                                   param: str) -> None:
    reply = await http.post("/v1/responses", json={"model": "fake", "input": "Hi", **fields})
    assert reply.status_code == 400, reply.text
    assert assert_openai_error(reply.json(), error_type="invalid_request_error")["param"] == param


async def test_allowed_tools_offers_only_those_it_names(http: httpx.AsyncClient, backend: RecordingBackend) -> None:
    choice = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "spawn_agent"}]}
    body = {"model": "fake", "input": "Hi", "tools": [EXEC_COMMAND, MULTI_AGENT], "tool_choice": choice}
    reply = await http.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    tools_shown = [line for line in backend.prompts[-1].splitlines() if line.startswith("<tool>")]
    assert [line.split(":")[0] for line in tools_shown] == ["<tool>spawn_agent"]
    assert reply.json()["tool_choice"] == choice


# ---- namespaces ---------------------------------------------------------------------------------------------


async def test_a_namespace_is_offered_as_its_functions(http: httpx.AsyncClient, backend: RecordingBackend) -> None:
    body = {"model": "fake", "input": "Hi", "tools": [EXEC_COMMAND, MULTI_AGENT]}
    assert (await http.post("/v1/responses", json=body)).status_code == 200
    tools_shown = [line for line in backend.prompts[-1].splitlines() if line.startswith("<tool>")]
    assert tools_shown == [
        f"<tool>exec_command: {EXEC_COMMAND['description']}</tool>",
        f"<tool>spawn_agent: {MULTI_AGENT['description']}",  # the namespace's description opens its functions'
        f"<tool>close_agent: {MULTI_AGENT['description']}",
    ]
    assert f"{MULTI_AGENT['description']}\n\n{SPAWN_AGENT['description']}</tool>" in backend.prompts[-1]


async def test_a_call_to_a_namespaced_function_comes_back_with_its_namespace(client: openai.AsyncOpenAI,
                                                                             http: httpx.AsyncClient) -> None:
    tools: Any = [EXEC_COMMAND, MULTI_AGENT]
    response = await client.responses.create(model="fake", input="Spawn one.", tools=tools)
    [call] = response.output
    assert call.type == "function_call" and (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")
    assert json.loads(call.arguments) == {"message": "look"}
    body = {"model": "fake", "input": "Spawn one.", "tools": tools, "stream": True}
    events = events_of((await http.post("/v1/responses", json=body)).text)
    items = [e["item"] for e in events if e["type"] in ("response.output_item.added", "response.output_item.done")]
    assert [(item["name"], item["namespace"]) for item in items] == [("spawn_agent", "multi_agent_v1")] * 2
    assert events[-1]["response"]["output"][0]["namespace"] == "multi_agent_v1"
    async with client.responses.stream(model="fake", input="Spawn one.", tools=tools) as stream:
        final = await stream.get_final_response()
    assert [(item.name, item.namespace) for item in final.output] == [("spawn_agent", "multi_agent_v1")]  # type: ignore[union-attr]


async def test_a_namespaced_call_sent_back_is_shown_as_it_was_offered(client: openai.AsyncOpenAI,
                                                                      backend: RecordingBackend) -> None:
    call: Any = {"type": "function_call", "call_id": "call_1", "name": "spawn_agent", "namespace": "multi_agent_v1",
                 "arguments": '{"message": "look"}'}
    output: Any = {"type": "function_call_output", "call_id": "call_1", "output": "agent a1 started"}
    clash: Any = {**SPAWN_AGENT, "description": "A top-level function of the same name."}
    for tools, shown in [([MULTI_AGENT], "spawn_agent"), ([clash, MULTI_AGENT], "multi_agent_v1.spawn_agent")]:
        response = await client.responses.create(model="fake", input=[call, output], tools=tools, tool_choice="none")
        assert response.status == "completed"
        assert f"<tool_call>{shown}</tool_call>" in backend.prompts[-1]
        listed = (await client.responses.input_items.list(response.id, order="asc")).data
        assert listed[0].namespace == "multi_agent_v1"  # type: ignore[union-attr]


async def test_tool_choice_may_name_a_namespaced_function(client: openai.AsyncOpenAI) -> None:
    tools: Any = [EXEC_COMMAND, MULTI_AGENT]
    for choice in [{"type": "function", "name": "spawn_agent"},
                   {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}]:
        response = await client.responses.create(model="fake", input="Spawn.", tools=tools, tool_choice=choice)  # type: ignore[arg-type]
        [call] = response.output
        assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")  # type: ignore[union-attr]


async def test_the_codex_request_streams_a_completed_response(http: httpx.AsyncClient) -> None:
    reply = await http.post("/v1/responses", json=codex_request("fake"))
    assert reply.status_code == 200, reply.text
    assert reply.headers[IGNORED_TOOLS_HEADER] == "web_search"
    events = events_of(reply.text)
    assert events[-1]["type"] == "response.completed"
    [call] = events[-1]["response"]["output"]
    assert (call["name"], call["namespace"]) == ("spawn_agent", "multi_agent_v1")


# ---- the tool set -------------------------------------------------------------------------------------------


def tools_of(*tools: dict[str, Any]) -> list[wire.Tool]:
    return wire.ResponseRequest.model_validate({"model": "m", "tools": list(tools)}).tools or []


def namespace(name: str, *functions: dict[str, Any]) -> dict[str, Any]:
    return {"type": "namespace", "name": name, "description": f"The {name} tools.", "tools": list(functions)}


def function(name: str) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(("tools", "shown"), [
    ([function("a"), namespace("n", function("b"))], ["a", "b"]),
    ([function("a"), namespace("n", function("a"))], ["a", "n.a"]),  # a top-level name keeps its plain form
    ([namespace("m", function("a")), namespace("n", function("a"), function("b"))], ["m.a", "n.a", "b"]),
    ([namespace("n", function("a"), {"type": "custom", "name": "c"})], ["a"]),
])
def test_namespaced_functions_are_qualified_only_where_a_name_is_taken(tools: list[dict[str, Any]],
                                                                       shown: list[str]) -> None:
    offered = offered_tools(tools_of(*tools))
    assert [f.shown for f in offered.functions] == shown
    for f in offered.functions:
        assert offered.origin(f.shown) == (f.name, f.namespace)
        assert offered.shown(f.name, f.namespace) == f.shown


def test_names_the_model_may_use_map_back_to_the_function() -> None:
    offered = offered_tools(tools_of(function("a"), namespace("n", function("b"))))
    assert offered.origin("b") == ("b", "n")
    assert offered.origin("n.b") == ("b", "n")  # the qualified form is understood too
    assert offered.origin("zzz") == ("zzz", None)
    assert offered.shown("b", "other") == "b"  # a namespace this request does not offer: the plain name


@pytest.mark.parametrize("tools", [
    [function("a"), function("a")],
    [namespace("n", function("a")), namespace("n", function("a"))],
])
def test_two_functions_of_one_name_are_a_400(tools: list[dict[str, Any]]) -> None:
    with pytest.raises(InvalidRequest) as caught:
        offered_tools(tools_of(*tools))
    assert caught.value.param == "tools" and "'" in caught.value.message


def test_a_name_two_namespaces_share_needs_the_namespace_in_tool_choice() -> None:
    offered = offered_tools(tools_of(namespace("m", function("a")), namespace("n", function("a"))))
    with pytest.raises(InvalidRequest, match="more than one namespace"):
        chat_tools(offered, wire.FunctionChoice(type="function", name="a"))
    _, forced = chat_tools(offered, wire.FunctionChoice(type="function", name="a", namespace="n"))
    assert forced == "n.a"


def test_the_header_lists_each_type_once_in_a_safe_form() -> None:
    assert ignored_header([]) == {}
    assert ignored_header(["web_search", "mcp", "web_search"]) == {IGNORED_TOOLS_HEADER: "web_search, mcp"}
    assert ignored_header(["bad\r\nname é"]) == {IGNORED_TOOLS_HEADER: "bad__name__"}
    many = ignored_header([f"t{i}" for i in range(30)])[IGNORED_TOOLS_HEADER]
    assert many.endswith("t15, ...")


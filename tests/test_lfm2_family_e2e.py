"""What a user of the LFM2 family gets, for each member (lfm2 hybrid, lfm2moe, lfm2-vl) in each form (the GGUF
llama.cpp's converter makes, served by llama.cpp; the transformers repository, served by vLLM), through a real
`lmserve serve`, the official `ollama` client and the `lmserve` CLI:

- `show` reports the family, the real parameter count (as the local runner writes it), the quantization, the
  context length and the capabilities;
- the model card's sampling (lfm2.md: LFM2 text temperature 0.3, min_p 0.15, repetition_penalty 1.05; LFM2-VL
  temperature 0.1) written into each member's generation_config.json — which the converter carries into the GGUF's
  `general.sampling.*` — is shown as the model's parameters and applies where the request and Modelfile are silent;
- the seed's LFM2 Modelfile, verbatim but for its FROM line, creates a model that chats, from either form.

The expected facts are read independently of lmserve (gguf's GGUFReader, safetensors, config.json). The weights are
random: replies are checked for structure, and sampling by equality of seeded replies. vLLM starts twice (one per
text repository, one at a time).

A second server, `--engine mlx` (its engine applies to all of its models, and MLX serves no GGUF), serves the text
repositories with LFM2's and LFM2.5's chat templates written in (forced calls in LFM2's own format, the card's
sampling, show, the seed's Modelfile) and refuses, with a 400 naming why, LFM2-VL's repository and an LFM2 without
convolution layers. It needs no GGUF converter: where llama.cpp's is missing only the other server's tests skip.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import httpx
import ollama
import pytest
from PIL import Image
from safetensors import safe_open

from lmserve.engine.vllm.vision import vision_support_missing
from lmserve.service.catalog import StoreCatalog
from lmserve.service.precedence import Precedence
from lmserve.store.modelfile import Modelfile
from lmserve.store.modelfile import parse as parse_modelfile
from lmserve.store.store import Store
from lmserve.types import RequestOptions, SamplingParams
from tests.hf_repos import (
    VERSION,
    ConverterMissing,
    cached_folder,
    lfm2_gguf,
    tiny_lfm2_attention_repo,
    tiny_lfm2_moe_repo,
    tiny_lfm2_repo,
    tiny_lfm2_vl_repo,
)
from tests.store.test_modelfile import LFM2_MODELFILE
from tests.test_lfm2_tools_e2e import LFM25_TEMPLATE
from tests.test_server import Server
from tests.tiny_lfm2 import LFM2_TEMPLATE

TIMEOUT = 300.0

LFM2_CARD = {"temperature": 0.3, "min_p": 0.15, "repetition_penalty": 1.05}
VL_CARD = {"temperature": 0.1, "min_p": 0.15, "repetition_penalty": 1.05}
"""The model cards' recommended sampling (shared/reference/lfm2.md), as generation_config.json writes it."""

SEED_MODELFILE = LFM2_MODELFILE.split("\n", 1)[1]
"""The seed's LFM2 Modelfile after its `FROM /path/to/model.gguf` line, verbatim."""


@dataclass(frozen=True)
class Member:
    """One member of the family in both forms, with its card written into generation_config.json."""

    key: str
    family_gguf: str
    card: dict[str, float]
    repo: Path
    gguf: Path
    projector: Path | None = None


MEMBERS = {"lfm2": ("lfm2", LFM2_CARD, tiny_lfm2_repo), "lfm2moe": ("lfm2moe", LFM2_CARD, tiny_lfm2_moe_repo),
           "lfm2-vl": ("lfm2", VL_CARD, tiny_lfm2_vl_repo)}  # fmt: skip
"""Member → the architecture llama.cpp names its GGUF, its card, its tiny repository."""


def write_repo(root: Path, key: str, name: str | None = None, template: str | None = None) -> Path:
    """A member's repository as `root/<name or key>`, with its card in generation_config.json and, given one, another
    chat template (in both places transformers reads it)."""
    _, card, make = MEMBERS[key]
    repo = Path(shutil.copytree(make(), root / (name or key)))
    generation = json.loads((repo / "generation_config.json").read_text())
    (repo / "generation_config.json").write_text(json.dumps({**generation, **card}, indent=2))
    if template is not None:
        (repo / "chat_template.jinja").write_text(template)
        tokenizer = json.loads((repo / "tokenizer_config.json").read_text())
        (repo / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "chat_template": template}, indent=2))
    return repo


def write_members(root: Path) -> None:
    """Each member's repository with its card in generation_config.json, its GGUF (converted from it) and, for the
    VL, its projector named as the local runner names one (`mmproj-…`, by which a second FROM is the projector)."""
    for key in MEMBERS:
        repo = write_repo(root, key)
        lfm2_gguf(repo)
        if key == "lfm2-vl":
            lfm2_gguf(repo, projector=True).rename(root / f"mmproj-{key}-F32.gguf")


@pytest.fixture(scope="module")
def members() -> dict[str, Member]:
    """The members, built once per machine (converting takes a while) as tests/hf_repos.py builds its own."""
    try:
        root = cached_folder(f"lfm2-family-cards-v{VERSION}", write_members)
    except ConverterMissing as exc:
        pytest.skip(str(exc))
    return {key: Member(key, family, card, root / key, root / f"{key}.gguf",
                        root / f"mmproj-{key}-F32.gguf" if key == "lfm2-vl" else None)
            for key, (family, card, _) in MEMBERS.items()}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    # One model loaded at a time: the two vLLM engines never run together.
    srv = Server("-c", "512", "-np", "2", env={"LMSERVE_MAX_LOADED_MODELS": "1"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def native(server: Server) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.base_url, timeout=TIMEOUT) as client:
        yield client


FORMS = [(key, form) for key in MEMBERS for form in ("gguf", "repo")]


@pytest.fixture(scope="module")
def stored(server: Server, members: dict[str, Member], tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Each member in each form created in the store by the CLI (a bare FROM: nothing but the model's own), named
    `<member>-<form>`."""
    directory = tmp_path_factory.mktemp("modelfiles")
    for key, form in FORMS:
        create(server, f"{key}-{form}", from_lines(members[key], form), directory)
    return [f"{key}-{form}" for key, form in FORMS]


def cli(server: Server, *args: str) -> subprocess.CompletedProcess[str]:
    """The `lmserve` command against the server."""
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}"}
    return subprocess.run([sys.executable, "-m", "lmserve", *args], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=TIMEOUT, check=False)


def create(server: Server, name: str, modelfile: str, directory: Path, *extra: str) -> None:
    path = directory / f"Modelfile.{name}"
    path.write_text(modelfile)
    done = cli(server, "create", name, "-f", str(path), *extra)
    assert done.returncode == 0, done.stdout + done.stderr


def from_lines(member: Member, form: str) -> str:
    if form == "repo":
        return f"FROM {member.repo}\n"
    return f"FROM {member.gguf}\n" + (f"FROM {member.projector}\n" if member.projector else "")


# ---- what the files say, read without lmserve ----------------------------------------------------------------------


def local_runner_count(n: int) -> str:
    """A parameter count as the local runner writes it (format.HumanNumber)."""
    for scale, unit, decimals in ((10**9, "B", 1), (10**6, "M", 2)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{decimals}f}{unit}"
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


def gguf_facts(path: Path) -> tuple[str, int, str]:
    """(architecture, number of values in its tensors, file type name) by gguf's own reader."""
    reader = gguf.GGUFReader(path)
    file_type = gguf.LlamaFileType(reader.fields["general.file_type"].contents())
    count = sum(int(t.n_elements) for t in reader.tensors)
    return reader.fields["general.architecture"].contents(), count, file_type.name.split("_", 1)[1]  # ALL_F32: F32


def repo_facts(repo: Path) -> tuple[str, int, str, int]:
    """(model_type, number of values in its safetensors, their one dtype, the text model's context length)."""
    count, dtypes = 0, set()
    with safe_open(repo / "model.safetensors", framework="numpy") as weights:
        for name in weights.keys():  # noqa: SIM118 (safe_open is no mapping)
            shape = weights.get_slice(name).get_shape()
            count += math.prod(shape)
            dtypes.add(weights.get_slice(name).get_dtype())
    config = json.loads((repo / "config.json").read_text())
    text = config.get("text_config", config)
    [dtype] = dtypes
    return config["model_type"], count, dtype, text["max_position_embeddings"]


def shown_parameters(text: str) -> dict[str, str]:
    """show's parameters text (`name   value` lines) as name → value text (a repeated name: its last value)."""
    return dict(line.split(None, 1) for line in text.splitlines() if line.strip())


# ---- show, for each member and form ------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "form"), FORMS, ids=[f"{k}-{f}" for k, f in FORMS])
def test_show_reports_family_size_quantization_context_and_capabilities(
    server: Server, native: ollama.Client, members: dict[str, Member], stored: list[str], key: str, form: str
) -> None:
    member = members[key]
    name = f"{key}-{form}"
    shown = native.show(name)
    assert shown.details is not None and shown.modelinfo is not None
    info = shown.modelinfo
    if form == "gguf":
        family, count, quantization = gguf_facts(member.gguf)
        assert family == member.family_gguf
        context = info[f"{family}.context_length"]
        assert context == repo_facts(member.repo)[3]
        vision = member.projector is not None
    else:
        family, count, quantization, context = repo_facts(member.repo)
        assert info[f"{family}.context_length"] == context
        vision = "vision_config" in json.loads((member.repo / "config.json").read_text()) and vision_support_missing(
            {"vision_config": {}}) is None  # vLLM serves the VL repository's images only with torchvision
    assert (shown.details.family, shown.details.format) == (family, form if form == "gguf" else "safetensors")
    assert info["general.parameter_count"] == count
    assert shown.details.parameter_size == local_runner_count(count)
    assert re.fullmatch(r"\d\.\d\dM", shown.details.parameter_size)  # 3.3 million values, not a label ("4x3.3M")
    assert shown.details.quantization_level == quantization == ("F32" if form == "gguf" else "BF16")
    capabilities = shown.capabilities or []
    assert capabilities[:2] == ["completion", "tools"]
    assert ("vision" in capabilities) == vision
    if member.projector is not None and form == "gguf":
        assert "clip" in (shown.details.families or [])
    # The card's sampling, from generation_config.json or the GGUF's general.sampling.*, as the model's parameters.
    assert shown_parameters(shown.parameters or "") == {
        "temperature": str(member.card["temperature"]), "min_p": str(member.card["min_p"]),
        "repeat_penalty": str(member.card["repetition_penalty"])}
    summary = cli(server, "show", name)
    assert summary.returncode == 0, summary.stderr
    for row in (("architecture", family), ("parameters", local_runner_count(count)),
                ("context length", str(context)), ("quantization", quantization)):
        assert re.search(rf"^\s*{row[0]}\s+{re.escape(row[1])}$", summary.stdout, re.MULTILINE), summary.stdout
    # listed alike
    [tag] = [m for m in native.list().models if m.model == f"{name}:latest"]
    assert tag.details is not None and tag.details.parameter_size == shown.details.parameter_size


def test_a_quantized_gguf_shows_its_level(server: Server, native: ollama.Client, members: dict[str, Member],
                                          tmp_path: Path) -> None:
    member = members["lfm2"]
    create(server, "lfm2-q8", from_lines(member, "gguf"), tmp_path, "-q", "q8_0")
    shown = native.show("lfm2-q8")
    assert shown.details is not None and shown.modelinfo is not None
    _, count, _ = gguf_facts(member.gguf)
    assert shown.details.quantization_level == "Q8_0"
    assert shown.modelinfo["general.parameter_count"] == count  # the same values, fewer bits
    assert shown.details.parameter_size == local_runner_count(count)


# ---- the card's sampling applies where request and Modelfile are silent --------------------------------------------


def test_the_gguf_carries_the_card_from_generation_config(members: dict[str, Member]) -> None:
    """llama.cpp's converter writes generation_config.json's sampling into `general.sampling.*`."""
    for member in members.values():
        fields = gguf.GGUFReader(member.gguf).fields
        for key, card in (("temp", "temperature"), ("min_p", "min_p"), ("penalty_repeat", "repetition_penalty")):
            assert fields[f"general.sampling.{key}"].contents() == pytest.approx(member.card[card], rel=1e-6)


@pytest.mark.parametrize("form", ["gguf", "repo"])
async def test_option_layers_put_the_card_under_the_modelfile_and_over_the_server(
    members: dict[str, Member], form: str, tmp_path: Path
) -> None:
    catalog = StoreCatalog(Store(tmp_path / "store"), lambda path, options: pytest.fail("nothing loads"))
    member = members["lfm2"]
    source = str(member.gguf if form == "gguf" else member.repo)
    catalog.create("plain", Modelfile(from_=source))
    catalog.create("seeded", Modelfile(from_=source, parameters={"temperature": 0.1, "top_k": 50}))
    precedence, native, openai = Precedence(), RequestOptions(defaults="native"), RequestOptions()
    plain = precedence.sampling(catalog.settings("plain"), native, SamplingParams())
    assert (plain.temperature, plain.min_p, plain.repeat_penalty) == (0.3, 0.15, 1.05)
    assert plain.top_k == 40  # what the card does not say: the local runner's default
    seeded = precedence.sampling(catalog.settings("seeded"), native, SamplingParams())
    assert (seeded.temperature, seeded.top_k, seeded.min_p, seeded.repeat_penalty) == (0.1, 50, 0.15, 1.05)
    openai_route = precedence.sampling(catalog.settings("plain"), openai, SamplingParams())
    assert (openai_route.temperature, openai_route.min_p) == (0.3, 0.15)


RUNNER_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1}


def seeded_replies(native: ollama.Client, name: str, card: dict[str, float]) -> tuple[str, str, str]:
    """A seeded reply without sampling options, with the card's written out, and with the local runner's defaults."""
    base: dict[str, Any] = {"seed": 7, "num_predict": 24}
    explicit = {"temperature": card["temperature"], "min_p": card["min_p"],
                "repeat_penalty": card["repetition_penalty"], "top_k": 40, "top_p": 0.9}
    prompt = "Tell me a story about the sea and the wind."
    return tuple(native.generate(model=name, prompt=prompt, options={**base, **extra}).response  # type: ignore[return-value]
                 for extra in ({}, explicit, RUNNER_DEFAULTS))


def test_a_request_without_options_samples_with_the_card_gguf(native: ollama.Client, members: dict[str, Member],
                                                               stored: list[str]) -> None:
    silent, card, runner = seeded_replies(native, "lfm2-gguf", members["lfm2"].card)
    assert silent == card
    assert silent != runner  # the check can fail: the card's sampling differs from the local runner's here


# ---- the seed's Modelfile, verbatim, on each text member and form --------------------------------------------------


@pytest.mark.parametrize("form", ["gguf", "repo"])
@pytest.mark.parametrize("key", ["lfm2", "lfm2moe"])
def test_the_seed_modelfile_creates_a_model_that_chats(server: Server, native: ollama.Client,
                                                       members: dict[str, Member], stored: list[str], key: str,
                                                       form: str, tmp_path: Path) -> None:
    member = members[key]
    name = f"seed-{key}-{form}"
    create(server, name, from_lines(member, form) + SEED_MODELFILE, tmp_path)
    shown = cli(server, "show", name, "--modelfile")
    assert shown.returncode == 0, shown.stderr
    assert parse_modelfile(shown.stdout).parameters == parse_modelfile(f"FROM {name}\n{SEED_MODELFILE}").parameters
    reply = native.chat(model=name, messages=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hello there"}],
                        options={"num_predict": 8, "seed": 1})
    assert reply.done and reply.message.role == "assistant"
    assert reply.eval_count is not None and 1 <= reply.eval_count <= 8
    assert reply.prompt_eval_count is not None and reply.prompt_eval_count > 8
    if key == "lfm2" and form == "repo":  # the repository's engine is loaded now: the card applies on vLLM too
        silent, card, runner = seeded_replies(native, "lfm2-repo", member.card)
        assert silent == card and silent != runner
    assert_forced_call(server, f"{key}-{form}")  # the same weights, so the same loaded engine: no second start


SWITCH: Any = {"type": "function", "function": {
    "name": "switch_lights", "description": "Switch the lights of a room on or off.",
    "parameters": {"type": "object", "properties": {"room": {"type": "string", "enum": ["hall", "kitchen"]},
                                                    "on": {"type": "boolean"}},
                   "required": ["room", "on"]}}}


def assert_forced_call(server: Server, name: str, image: str | None = None) -> None:
    """A forced call to SWITCH (with an image in the user turn when given) comes back as a parsed tool call, in the
    member's own format (its template's; tests/test_lfm2_tools_e2e.py checks the formats themselves), or lmserve's
    JSON call format for a template that takes no tools (LFM2-VL's: the random weights spend tokens on whitespace
    there, hence the room)."""
    content: Any = "Turn on the hall lights."
    if image is not None:
        content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": content}]
    with server.client() as client:
        messages: Any = [{"role": "user", "content": content}]
        reply = client.chat.completions.create(model=name, messages=messages,
                                               tools=[SWITCH], tool_choice="required", max_tokens=400, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert call.function.name == "switch_lights"  # type: ignore[union-attr]
    assert arguments["room"] in ("hall", "kitchen") and isinstance(arguments["on"], bool)


def test_the_vision_gguf_sees_an_image_and_calls_tools(server: Server, stored: list[str]) -> None:
    """LFM2-VL on llama.cpp (text model GGUF + mmproj): an image costs prompt tokens and changes the reply's
    distribution, and a forced tool call with an image in the turn is parsed."""
    pixels = Image.new("RGB", (64, 64), (200, 30, 30))
    buffer = io.BytesIO()
    pixels.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    with server.client() as client:
        def ask(content: Any) -> Any:
            messages: Any = [{"role": "user", "content": content}]
            return client.chat.completions.create(model="lfm2-vl-gguf", temperature=0, max_tokens=4, logprobs=True,
                                                  top_logprobs=3, messages=messages)
        text = ask("What colour is it?")
        seen = ask([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What colour is it?"}])
    assert text.usage is not None and seen.usage is not None
    assert seen.usage.prompt_tokens > text.usage.prompt_tokens  # the image's tokens
    assert seen.choices[0].logprobs != text.choices[0].logprobs  # what the model computes depends on the image
    assert_forced_call(server, "lfm2-vl-gguf", image=url)


def test_the_vision_repository_is_refused_where_vllm_cannot_see(native: ollama.Client, members: dict[str, Member],
                                                                 stored: list[str]) -> None:
    missing = vision_support_missing(json.loads((members["lfm2-vl"].repo / "config.json").read_text()))
    if missing is None:
        pytest.skip("vLLM serves images here (torchvision works): the repository is a vision model, shown so")
    with pytest.raises(ollama.ResponseError) as refused:
        native.generate(model="lfm2-vl-repo", prompt="hi", options={"num_predict": 1})
    assert refused.value.status_code == 400 and "torchvision" in str(refused.value.error)
    assert "vision" not in (native.show("lfm2-vl-repo").capabilities or [])


# ---- MLX: the repositories on `lmserve serve --engine mlx` ---------------------------------------------------------


MLX_MODELS: dict[str, tuple[str, str | None]] = {
    "mlx-lfm2": ("lfm2", LFM2_TEMPLATE), "mlx-lfm2-lfm25": ("lfm2", LFM25_TEMPLATE),
    "mlx-lfm2moe": ("lfm2moe", LFM2_TEMPLATE), "mlx-lfm2-vl": ("lfm2-vl", None)}
"""The models the MLX server stores → their member and chat template: LFM2's own (tests/tiny_lfm2.py; the tiny
repositories' is a plain chat template that takes no tools) or LFM2.5's (tests/test_lfm2_tools_e2e.py: the tools in
the system turn without list tokens), so the calls are checked in the members' own format."""
MLX_TEXT = ["mlx-lfm2", "mlx-lfm2moe"]


@pytest.fixture(scope="module")
def mlx_repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each of MLX_MODELS's repositories, its card in its generation_config.json as for the other server (no GGUF
    needed), in a directory of the model's name: name → repository."""
    if importlib.util.find_spec("mlx_lm") is None:  # not imported: MLX is imported through the engine (OpenBLAS)
        pytest.skip("the MLX engine needs mlx and mlx-lm (pip install 'lmserve[mlx]')")
    root = tmp_path_factory.mktemp("mlx-repos")
    return {name: write_repo(root, key, name, template) for name, (key, template) in MLX_MODELS.items()}


@pytest.fixture(scope="module")
def mlx_server(mlx_repos: dict[str, Path]) -> Iterator[Server]:
    """A server of its own: `--engine` applies to all of a server's models, and MLX serves no GGUF (so it starts with
    LFM2's repository, not the embedded GGUF). One model loaded at a time, like the other server's."""
    srv = Server("-c", "512", "-np", "2", "--engine", "mlx", "--model", str(mlx_repos["mlx-lfm2"]),
                 env={"LMSERVE_MAX_LOADED_MODELS": "1"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def mlx_native(mlx_server: Server) -> Iterator[ollama.Client]:
    with ollama.Client(host=mlx_server.base_url, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def mlx_stored(mlx_server: Server, mlx_repos: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, Path]:
    """Each of MLX_MODELS created in the MLX server's store by the CLI from a bare FROM of its repository."""
    directory = tmp_path_factory.mktemp("mlx-modelfiles")
    for name, repo in mlx_repos.items():
        create(mlx_server, name, f"FROM {repo}\n", directory)
    return mlx_repos


@pytest.mark.parametrize("name", MLX_TEXT)
def test_mlx_show_reports_family_size_context_and_capabilities(mlx_native: ollama.Client,
                                                               mlx_stored: dict[str, Path], name: str) -> None:
    family, count, quantization, context = repo_facts(mlx_stored[name])
    shown = mlx_native.show(name)
    assert shown.details is not None and shown.modelinfo is not None
    assert (shown.details.family, shown.details.format) == (family, "safetensors")
    assert shown.modelinfo[f"{family}.context_length"] == context
    assert shown.modelinfo["general.parameter_count"] == count
    assert shown.details.parameter_size == local_runner_count(count)
    assert shown.details.quantization_level == quantization == "BF16"  # the repository's (MLX computes in float32)
    capabilities = shown.capabilities or []
    assert capabilities[:2] == ["completion", "tools"] and "vision" not in capabilities
    assert shown_parameters(shown.parameters or "") == {
        "temperature": str(LFM2_CARD["temperature"]), "min_p": str(LFM2_CARD["min_p"]),
        "repeat_penalty": str(LFM2_CARD["repetition_penalty"])}


def rendered(server: Server, name: str, messages: list[dict[str, Any]], tools: list[Any]) -> str:
    """The chat as the server renders it with the model's template (POST /tokenize, then /detokenize)."""
    tokens = httpx.post(server.base_url + "/tokenize", json={"model": name, "messages": messages, "tools": tools},
                        timeout=TIMEOUT)
    assert tokens.status_code == 200, tokens.text
    text = httpx.post(server.base_url + "/detokenize", json={"model": name, "tokens": tokens.json()["tokens"]},
                      timeout=TIMEOUT)
    assert text.status_code == 200, text.text
    return str(text.json()["content"])


@pytest.mark.parametrize("name", ["mlx-lfm2", "mlx-lfm2-lfm25", "mlx-lfm2moe"])
def test_mlx_calls_tools_in_the_members_format_and_samples_with_the_card(
    mlx_server: Server, mlx_native: ollama.Client, mlx_stored: dict[str, Path], name: str
) -> None:
    """Each text member with LFM2's template, and LFM2 with LFM2.5's: the template puts the tools where it puts them,
    a forced call is written in LFM2's own format (the detected `lfm2` parser's grammar, not lmserve's JSON calls)
    and comes back parsed; and a request without sampling options samples with the card (one test per model: the
    server holds one model at a time)."""
    listed = json.dumps(SWITCH, ensure_ascii=False)
    ask: Any = [{"role": "user", "content": "Turn on the hall lights."}]
    text = rendered(mlx_server, name, ask, [SWITCH])
    if MLX_MODELS[name][1] == LFM2_TEMPLATE:
        assert f"List of tools: <|tool_list_start|>[{listed}]<|tool_list_end|><|im_end|>" in text, text
    else:
        assert f"List of tools: [{listed}]<|im_end|>" in text and "<|tool_list_start|>" not in text, text
    assert_forced_call(mlx_server, name)
    with mlx_server.client() as client:
        reply = client.chat.completions.create(model=name, messages=ask, tools=[SWITCH], tool_choice="required",
                                               max_tokens=120, temperature=0, logprobs=True)
    [choice] = reply.choices
    [call] = choice.message.tool_calls or []
    written = "".join(token.token for token in (choice.logprobs.content if choice.logprobs else None) or [])
    start, end = "<|tool_call_start|>", "<|tool_call_end|>"
    assert written.startswith(start) and written.endswith(end), written
    assert json.loads(written[len(start):-len(end)]) == [
        {"name": call.function.name, "arguments": json.loads(call.function.arguments)}]  # type: ignore[union-attr]
    silent, card, runner = seeded_replies(mlx_native, name, LFM2_CARD)
    assert silent == card
    assert silent != runner  # the check can fail: the card's sampling differs from the local runner's here


@pytest.mark.parametrize("name", ["mlx-lfm2moe", "mlx-lfm2"])  # the MoE first: the one loaded now
def test_mlx_the_seed_modelfile_creates_a_model_that_chats(mlx_server: Server, mlx_native: ollama.Client,
                                                           mlx_stored: dict[str, Path], name: str,
                                                           tmp_path: Path) -> None:
    seed = f"seed-{name}"
    create(mlx_server, seed, f"FROM {mlx_stored[name]}\n" + SEED_MODELFILE, tmp_path)
    shown = cli(mlx_server, "show", seed, "--modelfile")
    assert shown.returncode == 0, shown.stderr
    assert parse_modelfile(shown.stdout).parameters == parse_modelfile(f"FROM {seed}\n{SEED_MODELFILE}").parameters
    reply = mlx_native.chat(model=seed, messages=[{"role": "system", "content": "Be brief."},
                                                  {"role": "user", "content": "Hello there"}],
                            options={"num_predict": 8, "seed": 1})
    assert reply.done and reply.message.role == "assistant"
    assert reply.eval_count is not None and 1 <= reply.eval_count <= 8
    assert reply.prompt_eval_count is not None and reply.prompt_eval_count > 8


def test_mlx_refuses_what_mlx_lm_cannot_run_naming_why(mlx_server: Server, mlx_native: ollama.Client,
                                                       mlx_stored: dict[str, Path], tmp_path: Path) -> None:
    """LFM2-VL's repository (mlx-lm has no `lfm2_vl` model type) and an LFM2 without convolution layers (mlx-lm's
    `lfm2` model builds it, then fails on its first tokens: the load's two probe tokens find it) are refused with a
    400 that says why, and the server goes on serving."""
    create(mlx_server, "mlx-lfm2-attention", f"FROM {tiny_lfm2_attention_repo()}\n", tmp_path)
    for name, why in (("mlx-lfm2-vl", ("MLX cannot load", "Model type lfm2_vl not supported", "mlx-vlm")),
                      ("mlx-lfm2-attention", ("MLX cannot run", "mlx-lm's lfm2 model fails on its first tokens "
                                                                "(IndexError"))):
        with pytest.raises(ollama.ResponseError) as refused:
            mlx_native.generate(model=name, prompt="hi", options={"num_predict": 1})
        error = str(refused.value.error)
        assert refused.value.status_code == 400 and error.startswith(f"model '{name}:latest' cannot be served here: ")
        assert all(part in error for part in why), error
    assert "vision" not in (mlx_native.show("mlx-lfm2-vl").capabilities or [])
    assert mlx_native.generate(model="mlx-lfm2", prompt="hi", options={"num_predict": 2}).done

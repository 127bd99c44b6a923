"""End to end with a tiny random LFM2 (hybrid conv + attention) model: the seed's LFM2 Modelfile through the CLI
and the `ollama` client, and the GGUF's own Jinja template through the `openai` client.

The weights are random, so the tests assert structure (token counts, determinism, cache accounting), not wording.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import llama_cpp as lc
import ollama
import pytest
from openai.types.chat import ChatCompletionMessageParam

from lmserve.store.modelfile import parse as parse_modelfile
from tests.test_server import Server, alone_and_together
from tests.tiny_lfm2 import write_tiny_lfm2

TEMPLATE = (
    "<|startoftext|><|im_start|>system\n{{ .System }}<|im_end|>\n<|im_start|>user\n{{ .Prompt }}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
MODELFILE = (
    "FROM ./tiny-lfm2.gguf\n"
    f'TEMPLATE """{TEMPLATE}"""\n'
    "PARAMETER temperature 0.1\n"
    "PARAMETER top_k 50\n"
    "PARAMETER repeat_penalty 1.05\n"
    'PARAMETER stop "<|im_end|>"\n'
    'PARAMETER stop "<|endoftext|>"\n'
)
"""The seed's LFM2 Modelfile, verbatim but for the FROM path."""

SERVED = "tiny-lfm2"
"""The name `serve -m tiny-lfm2.gguf` gives the file."""

Counter = Callable[[str], int]
Cli = Callable[..., "subprocess.CompletedProcess[str]"]


def rendered(system: str, prompt: str) -> str:
    """TEMPLATE (and, with a system prompt, the GGUF's LFM2 Jinja template) rendered for one user turn."""
    return (
        f"<|startoftext|><|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("lfm2")
    write_tiny_lfm2(directory / "tiny-lfm2.gguf")
    (directory / "Modelfile").write_text(MODELFILE)
    return directory


@pytest.fixture(scope="module")
def count_tokens(model_dir: Path) -> Iterator[Counter]:
    """Token count of a text (specials parsed, nothing added) by llama.cpp itself, with the tiny model's vocab."""
    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(model_dir / "tiny-lfm2.gguf").encode(), params)
    assert model
    vocab = lc.llama_model_get_vocab(model)

    def count(text: str) -> int:
        data = text.encode()
        buf = (lc.llama_token * (len(data) + 8))()
        n = lc.llama_tokenize(vocab, data, len(data), buf, len(buf), False, True)
        assert n > 0
        return int(n)

    yield count
    lc.llama_model_free(model)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    srv = Server("-m", str(model_dir / "tiny-lfm2.gguf"), "-np", "2", "-c", "512")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cli(server: Server, model_dir: Path) -> Cli:
    env = {**os.environ, "LMSERVE_HOST": f"127.0.0.1:{server.port}"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "lmserve", *args], env=env, cwd=model_dir, capture_output=True,
                              text=True, timeout=120, check=False)

    return run


@pytest.fixture(scope="module")
def created(cli: Cli) -> str:
    result = cli("create", "lfm2-tiny", "-f", "Modelfile")
    assert result.returncode == 0, result.stderr
    return "lfm2-tiny"


@pytest.fixture
def client(server: Server) -> Iterator[ollama.Client]:
    with ollama.Client(host=server.base_url) as c:
        yield c


# ---- the seed's Modelfile through the CLI and the ollama client ----------------------------------------------


def test_generate_uses_the_modelfile_template(client: ollama.Client, created: str, count_tokens: Counter) -> None:
    count = count_tokens  # the rendered TEMPLATE's tokens: BOS and the turn markers are one token each
    reply = client.generate(model=created, prompt="hi there", system="Be brief.", options={"num_predict": 6, "seed": 1})
    assert reply.done and reply.eval_count is not None and 1 <= reply.eval_count <= 6
    assert reply.prompt_eval_count == count(rendered("Be brief.", "hi there"))
    raw = client.generate(model=created, prompt=rendered("Be brief.", "hi there"), raw=True,
                          options={"num_predict": 2})
    assert raw.done and raw.prompt_eval_count == reply.prompt_eval_count
    # Without a system prompt TEMPLATE still writes an empty system turn (the GGUF's Jinja template would not).
    bare = client.generate(model=created, prompt="hi there", options={"num_predict": 2})
    assert bare.prompt_eval_count == count(rendered("", "hi there"))
    assert bare.prompt_eval_count == reply.prompt_eval_count - count("Be brief.")


def test_chat_with_the_modelfile_template(client: ollama.Client, created: str, count_tokens: Counter) -> None:
    reply = client.chat(model=created, messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "hi there"}],
                        options={"num_predict": 6, "seed": 1})
    assert reply.done and reply.message.role == "assistant"
    assert reply.eval_count is not None and 1 <= reply.eval_count <= 6
    assert reply.prompt_eval_count == count_tokens(rendered("Be brief.", "hi there"))
    streamed = list(client.chat(model=created, messages=[{"role": "user", "content": "hi"}], stream=True,
                                options={"num_predict": 4}))
    assert streamed[-1].done and not any(part.done for part in streamed[:-1])


def test_show_gives_back_the_modelfile(client: ollama.Client, created: str, cli: Cli) -> None:
    shown = cli("show", created, "--modelfile")
    assert shown.returncode == 0, shown.stderr
    original, back = parse_modelfile(MODELFILE), parse_modelfile(shown.stdout)
    assert back.parameters == original.parameters == {
        "temperature": 0.1, "top_k": 50, "repeat_penalty": 1.05, "stop": ["<|im_end|>", "<|endoftext|>"],
    }
    assert back.template == original.template == TEMPLATE
    details = client.show(created).details
    assert details is not None and details.family == "lfm2" and details.format == "gguf"
    served = client.show(SERVED).details
    assert served is not None and served.family == "lfm2"


# ---- the GGUF served directly, its Jinja template, the openai client ------------------------------------------


def test_chat_completion_renders_the_gguf_template(server: Server, count_tokens: Counter) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"},
    ]
    with server.client() as client:
        reply = client.chat.completions.create(model=SERVED, messages=messages, temperature=0, max_tokens=6)
        assert reply.usage is not None
        assert reply.usage.prompt_tokens == count_tokens(rendered("Be brief.", "hi there"))
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens >= 1
        # No system message: the Jinja template writes no system turn at all.
        bare = client.chat.completions.create(model=SERVED, messages=messages[1:], temperature=0, max_tokens=2)
        expected = "<|startoftext|><|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
        assert bare.usage is not None and bare.usage.prompt_tokens == count_tokens(expected)


def test_repeated_prompt_on_hybrid_memory_recomputes_and_agrees(server: Server) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me about the sea."}]
    with server.client() as client:
        runs = [client.chat.completions.create(model=SERVED, messages=messages, temperature=0, max_tokens=12)
                for _ in range(3)]
    texts = [r.choices[0].message.content for r in runs]
    assert texts[0] and texts == [texts[0]] * 3
    for reply in runs[1:]:
        # The conv state cannot be cut back to a prefix: the slot is cleared and the prompt computed again.
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_chats_sharing_a_system_prompt_restore_its_snapshot(server: Server, count_tokens: Counter) -> None:
    """The service marks where the system prompt ends; the engine snapshots the hybrid state there, so the next
    conversation with that system prompt starts from it."""
    system = "You answer questions about the sea, briefly and kindly. " * 6
    with server.client() as client:
        for question in ("What is a wave?", "Why is the sea salty?"):
            reply = client.chat.completions.create(
                model=SERVED, temperature=0, max_tokens=4,
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    system_turn = f"<|startoftext|><|im_start|>system\n{system}<|im_end|>\n"
    assert reply.usage.prompt_tokens_details.cached_tokens == count_tokens(system_turn)


def test_two_concurrent_requests_equal_each_alone(server: Server) -> None:
    alone, together = alone_and_together(server, SERVED, ["Write about rain.", "Count to five please."], max_tokens=16)
    assert together == alone
    assert all(alone)


def test_streamed_chat_equals_the_whole_reply(server: Server) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something."}]
    with server.client() as client:
        whole = client.chat.completions.create(model=SERVED, messages=messages, temperature=0, max_tokens=10)
        chunks = list(client.chat.completions.create(model=SERVED, messages=messages, temperature=0, max_tokens=10,
                                                     stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content


def test_a_hybrid_model_drafts_on_request_and_answers_the_same(server: Server) -> None:
    """Speculative decoding on hybrid memory (engine/llamacpp/recurrent_state.py), asked per request through the
    native API."""
    body = {"model": SERVED, "stream": False, "messages": [{"role": "user", "content": "abc abc abc abc abc abc"}],
            "options": {"temperature": 0, "num_predict": 60}}
    plain = httpx.post(server.base_url + "/api/chat", json=body, timeout=60).json()
    drafted = httpx.post(server.base_url + "/api/chat", timeout=60,
                         json={**body, "options": {**body["options"], "draft_max": 8}}).json()
    assert drafted["message"]["content"] == plain["message"]["content"]
    assert drafted["draft_count"] > 0 and "draft_count" not in plain


def test_tiny_model_is_hybrid_and_tokenizes_specials(model_dir: Path) -> None:
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(model_dir / "tiny-lfm2.gguf").encode(), lc.llama_model_default_params())
    assert model
    try:
        assert lc.llama_model_is_hybrid(model) and not lc.llama_model_is_recurrent(model)
        vocab = lc.llama_model_get_vocab(model)
        assert (lc.llama_vocab_bos(vocab), lc.llama_vocab_eos(vocab)) == (1, 7)
        assert lc.llama_vocab_is_eog(vocab, 2) and lc.llama_vocab_is_eog(vocab, 7)
        text = b"<|im_start|>user\nhi<|im_end|>\n"
        buf = (lc.llama_token * 32)()
        n = lc.llama_tokenize(vocab, text, len(text), buf, len(buf), True, True)
        tokens = list(buf[:n])
        assert tokens[:2] == [1, 6] and 7 in tokens and tokens.count(6) == 1
        assert all(lc.llama_vocab_is_control(vocab, t) for t in range(14))
        piece = ctypes.create_string_buffer(64)
        m = lc.llama_token_to_piece(vocab, 10, piece, len(piece), 0, True)
        assert piece.raw[:m] == b"<|tool_call_start|>"
        cparams = lc.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_seq_max = 256, 32, 1
        ctx = lc.llama_init_from_model(model, cparams)
        assert ctx
        batch = lc.llama_batch_init(32, 0, 1)
        try:
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(tokens) - 1
            batch.n_tokens = len(tokens)
            assert lc.llama_decode(ctx, batch) == 0
            memory = lc.llama_get_memory(ctx)
            assert lc.llama_memory_seq_pos_max(memory, 0) == len(tokens) - 1
            assert not lc.llama_memory_seq_rm(memory, 0, 2, -1)  # a conv state cannot be cut at a prefix
            assert lc.llama_memory_seq_rm(memory, 0, -1, -1)
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)
    finally:
        lc.llama_model_free(model)

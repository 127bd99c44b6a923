"""End to end: the web chat page in a real headless Chromium (Playwright), against a real `lmserve serve`.

One server serves the tiny random LFM2-VL model with its projector (tests/tiny_lfm2_vl.py) and, from the store, the
embedded SmolLM2: two models to pick from, one of them taking images. The tiny vision model writes gibberish, so its
test checks that an answer streamed without an error, never its wording. A second server, started with `--api-key`,
serves a tiny thinking model: it checks the key prompt, the folded reasoning, and then, stopped, the page's
message when the server is down.

Debian's chromium is driven directly (`make browser` installs it); Playwright's own browser download cannot work
here. Without /usr/bin/chromium the module is skipped.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.cores import all_cores
from tests.test_reasoning_e2e import THINKING_TEMPLATE
from tests.test_server import MODEL as TEXT_MODEL
from tests.test_server import Server
from tests.tiny_lfm2 import write_tiny_lfm2
from tests.tiny_lfm2_vl import write_tiny_lfm2_vl

CHROMIUM = "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium, or `make browser`)", allow_module_level=True)

VL_MODEL = "tiny-lfm2-vl:latest"
THINKER = "tiny-thinker:latest"
API_KEY = "web-page-key"
SCREENSHOT_COPY = Path("/tmp/lmserve-web-chat.png")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("tiny-vl")
    model, mmproj = directory / "tiny-lfm2-vl.gguf", directory / "mmproj-tiny-lfm2-vl.gguf"
    write_tiny_lfm2_vl(model, mmproj)
    with all_cores():  # the page's timing (a reply seen streaming in) is checked: the server is not starved
        srv = Server("-m", str(model), "--mmproj", str(mmproj), "-c", "2048", "-t", "1")
    yield srv
    log = srv.stop()
    assert "Traceback" not in log, log


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        with all_cores():  # the browser's processes, as the server's
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    """A fresh browser profile (empty localStorage) per test."""
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    context.set_default_timeout(TIMEOUT_MS)  # actions (click, fill, goto); assertions have their own:
    expect.set_options(timeout=TIMEOUT_MS)  # (5 s by default: too short for an answer on a loaded machine)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    context.close()
    assert errors == [], errors  # no uncaught exception in the page's script


# ---- helpers -------------------------------------------------------------------------------------------------------


def open_page(page: Page, server: Server, model: str | None = TEXT_MODEL) -> None:
    page.goto(server.base_url + "/")
    expect(page.locator("body.ready")).to_be_attached()
    if model is not None:
        page.select_option("#model", model)


def settings(page: Page, *, temperature: str = "0", max_tokens: str = "", system: str = "") -> None:
    page.click("#settings summary")
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)
    page.fill("#system-prompt", system)
    page.click("#settings summary")


def ask(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def last_answer(page: Page) -> Any:
    return page.locator(".message.assistant").last


def wait_until_answered(page: Page, state: str = "done") -> None:
    expect(last_answer(page)).to_have_attribute("data-state", state)


def stored_chats(page: Page) -> list[dict[str, Any]]:
    return list(json.loads(page.evaluate("localStorage.getItem('lmserve.chats')") or "[]"))


def record_answer_lengths(page: Page) -> None:
    """From now on, window.__lengths gets the last answer's text length at every change of the messages."""
    page.evaluate("""() => {
        window.__lengths = [];
        new MutationObserver(() => {
            const answers = document.querySelectorAll('.message.assistant .content');
            if (answers.length) window.__lengths.push(answers[answers.length - 1].textContent.length);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")


def running_sequences(server: Server) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(r"^lmserve_running_sequences\{[^}]*\} (\S+)$", text, re.M))


def eventually(check: Callable[[], bool], timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def png(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(out, "PNG")
    return out.getvalue()


# ---- the tests -----------------------------------------------------------------------------------------------------


STREAMED_ASK = "Write a long story about the sea."
STREAMED_TOKENS = 160
"""A reply long enough (about a second) that the page is seen partly written more than once: a haiku of 16 tokens
could arrive in two reads of the stream."""


def test_an_answer_streams_in_as_markdown_with_its_numbers(page: Page, server: Server, tmp_path: Path) -> None:
    open_page(page, server, model=None)
    first = page.locator("#model option").first.get_attribute("value")
    assert page.input_value("#model") == first  # the default: the first model listed
    page.select_option("#model", TEXT_MODEL)
    settings(page, max_tokens=str(STREAMED_TOKENS))
    record_answer_lengths(page)
    ask(page, STREAMED_ASK)
    expect(page.locator("#stop")).to_be_visible()
    wait_until_answered(page)
    lengths = page.evaluate("window.__lengths")
    final = len(last_answer(page).locator(".content").text_content() or "")
    growing = sorted({n for n in lengths if 0 < n < final})
    assert final > 0 and len(growing) >= 2, lengths  # seen partly written at least twice before the end
    expect(page.locator("#send")).to_be_visible()

    stats = last_answer(page).locator(".stats")
    expect(stats.locator(".tps")).to_have_text(re.compile(r"^\d+\.\d tokens/s$"))
    expect(stats.locator(".ttft")).to_have_text(re.compile(r"^TTFT \d+ ms$"))
    tokens = int((stats.locator(".tokens").text_content() or "").split()[0])
    assert 1 < tokens <= STREAMED_TOKENS

    with server.client() as client:  # the page sent what the chat holds, at temperature 0: the same reply
        reply = client.chat.completions.create(
            model=TEXT_MODEL, messages=[{"role": "user", "content": STREAMED_ASK}],
            temperature=0, max_tokens=STREAMED_TOKENS,
        )
    [chat] = stored_chats(page)
    assert chat["messages"][1]["content"] == reply.choices[0].message.content
    assert reply.usage is not None and tokens == reply.usage.completion_tokens
    expect(last_answer(page).locator(".message-head")).to_have_text(TEXT_MODEL)

    page.screenshot(path=tmp_path / "chat.png")
    shutil.copyfile(tmp_path / "chat.png", SCREENSHOT_COPY)
    page.set_viewport_size({"width": 390, "height": 760})  # a phone: the chats fold away behind a button
    expect(page.locator("#toggle-sidebar")).to_be_visible()
    expect(page.locator("#sidebar")).not_to_be_in_viewport()
    page.screenshot(path=tmp_path / "chat-narrow.png")
    shutil.copyfile(tmp_path / "chat-narrow.png", SCREENSHOT_COPY.with_name("lmserve-web-chat-narrow.png"))


def test_markdown_is_rendered_and_sanitised(page: Page, server: Server) -> None:
    open_page(page, server, model=None)
    source = ("Some **bold** text.\n\n```python\nprint('hi')\n```\n\n<script>window.hacked = 1</script>"
              "<img src=x onerror=\"window.hacked = 2\"> <b onclick=\"x()\">b</b>\n\n[link](javascript:alert(1))")
    html = page.evaluate("(text) => window.lmserveChat.renderMarkdown(text)", source)
    assert "<strong>bold</strong>" in html
    assert re.search(r'<pre><code class="language-python">print\(.*hi.*\)\n?</code></pre>', html)
    assert "<script" not in html and "onerror" not in html and "onclick" not in html
    assert ">link</a>" in html and "javascript:" not in html  # the link is kept, its script URL is not
    assert page.evaluate("window.hacked") is None


def test_stop_keeps_the_partial_answer_and_ends_the_generation(page: Page, server: Server) -> None:
    open_page(page, server)
    settings(page, temperature="1", max_tokens="3000")
    ask(page, "Write a very long story about a dragon and a knight, in many chapters.")
    content = last_answer(page).locator(".content")
    expect(content).to_have_text(re.compile(r"\S{20}|.{40}", re.S))
    assert last_answer(page).get_attribute("data-state") == "streaming"
    assert running_sequences(server) >= 1
    page.click("#stop")
    wait_until_answered(page, "stopped")
    kept = content.text_content() or ""
    assert kept
    expect(last_answer(page).locator(".stats")).to_contain_text("stopped")
    assert eventually(lambda: running_sequences(server) == 0), "the server still generates after the stop"
    time.sleep(0.5)
    assert content.text_content() == kept  # it stopped growing
    [chat] = stored_chats(page)
    assert chat["messages"][1]["content"] and chat["messages"][1]["stopped"] is True


def test_the_chosen_model_answers_and_is_remembered(page: Page, server: Server) -> None:
    open_page(page, server)
    expect(page.locator("#attach")).to_be_disabled()  # SmolLM2 takes no images
    page.select_option("#model", VL_MODEL)
    expect(page.locator("#attach")).to_be_enabled()
    settings(page, max_tokens="6")
    with page.expect_request("**/v1/chat/completions") as sent:
        ask(page, "Hello")
    assert sent.value.post_data_json["model"] == VL_MODEL
    wait_until_answered(page)
    expect(last_answer(page).locator(".message-head")).to_have_text(VL_MODEL)  # the model the server says answered
    page.reload()
    expect(page.locator("body.ready")).to_be_attached()
    assert page.input_value("#model") == VL_MODEL
    page.select_option("#model", TEXT_MODEL)
    expect(page.locator("#attach")).to_be_disabled()


def test_the_page_starts_on_the_model_the_server_serves(page: Page, server: Server) -> None:
    """The served model (VL_MODEL), not the newest stored name, nor a choice made while the server served another;
    a choice made while it serves the same model is kept (a reload)."""
    newest = "newest-copy:latest"
    assert httpx.post(server.base_url + "/api/copy", json={"source": TEXT_MODEL, "destination": newest}).is_success
    try:
        open_page(page, server, model=None)
        assert page.locator("#model option").all_text_contents()[0] == VL_MODEL
        assert newest in page.locator("#model option").all_text_contents()
        assert page.input_value("#model") == VL_MODEL
        for saved, starts_on in [
            (TEXT_MODEL, VL_MODEL),  # what an earlier version of the page stored
            ({"model": TEXT_MODEL, "served": "another:latest"}, VL_MODEL),  # chosen while another model was served
            ({"model": TEXT_MODEL, "served": VL_MODEL}, TEXT_MODEL),  # chosen while this one is served
            ({"model": "gone:latest", "served": VL_MODEL}, VL_MODEL),  # a model since deleted
        ]:
            page.evaluate("(saved) => localStorage.setItem('lmserve.model', JSON.stringify(saved))", saved)
            page.reload()
            expect(page.locator("body.ready")).to_be_attached()
            assert page.input_value("#model") == starts_on, saved
    finally:
        httpx.request("DELETE", server.base_url + "/api/delete", json={"model": newest})


def test_an_image_goes_to_the_vision_model(page: Page, server: Server, tmp_path: Path) -> None:
    open_page(page, server, model=VL_MODEL)
    expect(page.locator("#attach")).to_be_enabled()
    settings(page, max_tokens="8")
    page.set_input_files("#attach", files=[{"name": "red.png", "mimeType": "image/png", "buffer": png((255, 0, 0))}])
    expect(page.locator("#attachments img")).to_have_count(1)
    with page.expect_request("**/v1/chat/completions") as sent:
        ask(page, "What is in this picture?")
    parts = sent.value.post_data_json["messages"][-1]["content"]
    assert parts[0] == {"type": "text", "text": "What is in this picture?"}
    assert parts[1]["type"] == "image_url" and parts[1]["image_url"]["url"].startswith("data:image/png;base64,")
    wait_until_answered(page)
    expect(page.locator("#attachments img")).to_have_count(0)
    expect(page.locator(".message.user img")).to_have_count(1)  # the thumbnail stays with the question
    assert (last_answer(page).locator(".content").text_content() or "").strip()
    expect(page.locator("#error")).to_be_hidden()
    expect(last_answer(page).locator(".ttft")).to_be_visible()
    page.screenshot(path=tmp_path / "vision.png")
    shutil.copyfile(tmp_path / "vision.png", SCREENSHOT_COPY.with_name("lmserve-web-chat-vision.png"))


def test_an_error_shows_the_servers_message(page: Page, server: Server) -> None:
    open_page(page, server)
    settings(page, temperature="-1", max_tokens="4")
    ask(page, "Hi")
    wait_until_answered(page, "error")
    expect(page.locator("#error")).to_contain_text("Error 400")
    expect(page.locator("#error")).to_contain_text("temperature")


def test_conversations_persist_across_reload_new_chat_and_delete(page: Page, server: Server) -> None:
    open_page(page, server)
    settings(page, max_tokens="4")
    ask(page, "Say hi.")
    wait_until_answered(page)
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    ask(page, "Name a colour.")
    wait_until_answered(page)
    chats = page.locator("#chat-list .chat-title")
    expect(chats).to_have_text(["Name a colour.", "Say hi."])

    page.reload()
    expect(chats).to_have_text(["Name a colour.", "Say hi."])
    expect(page.locator(".message.user")).to_have_text(["Name a colour."])
    assert page.input_value("#max-tokens") == "4"  # the settings are kept too
    chats.filter(has_text="Say hi.").click()
    expect(page.locator(".message.user")).to_have_text(["Say hi."])
    expect(page.locator(".message.assistant")).to_have_count(1)

    page.click("[aria-label='Delete chat: Say hi.']")
    expect(chats).to_have_text(["Name a colour."])
    page.reload()
    expect(chats).to_have_text(["Name a colour."])
    assert [c["title"] for c in stored_chats(page)] == ["Name a colour."]


def test_the_key_is_asked_for_thinking_is_folded_and_a_stopped_server_is_reported(
    page: Page, tmp_path: Path
) -> None:
    """A server with `--api-key` over a tiny thinking model (its template opens `<think>`, so a reply cut by
    max_tokens is all reasoning): the page asks for the key, shows the reasoning folded, then reports the server
    gone once it is stopped."""
    thinker = write_tiny_lfm2(tmp_path / "tiny-thinker.gguf", chat_template=THINKING_TEMPLATE,
                              extra_specials=["<think>", "</think>"])
    secured = Server("-m", str(thinker), "--api-key", API_KEY, "-t", "1", "-c", "512")
    try:
        page.goto(secured.base_url + "/")
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()
        expect(page.locator("#key-reason")).to_contain_text("API key")
        page.fill("#api-key", "wrong-key")
        page.click("#key-save")
        expect(dialog).to_be_visible()  # refused again: asked again
        page.fill("#api-key", API_KEY)
        page.click("#key-save")
        expect(dialog).to_be_hidden()
        expect(page.locator("#model option")).to_have_count(2)  # the thinker and the embedded model
        assert page.evaluate("JSON.parse(localStorage.getItem('lmserve.apiKey'))") == API_KEY
        page.select_option("#model", THINKER)
        settings(page, max_tokens="8")
        ask(page, "Is 7 prime?")
        wait_until_answered(page)
        reasoning = last_answer(page).locator("details.reasoning")
        expect(reasoning.locator("summary")).to_have_text("Thought")
        assert reasoning.evaluate("details => details.open") is False  # folded
        assert (reasoning.locator(".reasoning-body").text_content() or "").strip()
        assert stored_chats(page)[0]["messages"][1]["reasoning"]
    finally:
        secured.stop()
    ask(page, "Are you there?")
    wait_until_answered(page, "error")
    expect(page.locator("#error")).to_contain_text("Cannot reach the server")

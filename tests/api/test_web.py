"""The web chat page's routes over the fake engine: `/` by Accept, the page's files, no traversal, no key needed."""

from __future__ import annotations

import re

import httpx
import pytest

from lmserve.http.web import INDEX, PLAIN_ROOT, WEB_PREFIX, content_type, wants_html, web_files

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,image/webp,*/*;q=0.8"


@pytest.mark.parametrize(
    ("accept", "html"),
    [
        (BROWSER_ACCEPT, True),
        ("text/html", True),
        ("application/xhtml+xml", True),
        ("TEXT/HTML; q=0.5", True),
        ("", False),
        ("*/*", False),  # curl
        ("application/json", False),
        ("text/plain, */*;q=0.1", False),
        ("text/html;q=0", False),
        ("text/html;q=nonsense", False),
    ],
)
def test_only_a_client_naming_html_wants_html(accept: str, html: bool) -> None:
    assert wants_html(accept) is html


async def test_a_browser_gets_the_page(client: httpx.AsyncClient) -> None:
    r = await client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert '<script type="module" src="/web/app.js"></script>' in r.text
    assert "script-src" not in r.headers["content-security-policy"]  # default-src 'self' covers scripts
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["vary"] == "Accept"


@pytest.mark.parametrize("accept", [None, "*/*", "application/json"])
async def test_other_clients_keep_the_plain_text(client: httpx.AsyncClient, accept: str | None) -> None:
    headers = {"Accept": accept} if accept is not None else {}
    r = await client.get("/", headers=headers)
    assert r.status_code == 200
    assert r.text == PLAIN_ROOT
    assert r.headers["content-type"].startswith("text/plain")


async def test_head_answers_both_ways(client: httpx.AsyncClient) -> None:
    page = await client.head("/", headers={"Accept": BROWSER_ACCEPT})
    plain = await client.head("/")
    assert (page.status_code, plain.status_code) == (200, 200)
    assert page.headers["content-type"].startswith("text/html")
    assert plain.headers["content-type"].startswith("text/plain")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("index.html", "text/html; charset=utf-8"),
        ("app.js", "text/javascript; charset=utf-8"),
        ("app.css", "text/css; charset=utf-8"),
        ("vendor/marked.esm.js", "text/javascript; charset=utf-8"),
        ("vendor/purify.min.js", "text/javascript; charset=utf-8"),
        ("vendor/marked.LICENSE", "text/plain; charset=utf-8"),
        ("vendor/README.md", "text/plain; charset=utf-8"),
    ],
)
async def test_the_page_files_are_served_with_their_content_type(
    client: httpx.AsyncClient, name: str, expected: str
) -> None:
    r = await client.get(WEB_PREFIX + name)
    assert r.status_code == 200
    assert r.headers["content-type"] == expected == content_type(name)
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.content == web_files()[name].read_bytes()


@pytest.mark.parametrize(
    "path",
    [
        "/web/../pyproject.toml",
        "/web/%2e%2e/api/web.py",
        "/web/%2E%2E/%2E%2E/pyproject.toml",
        "/web/vendor/%2e%2e/%2e%2e/api/app.py",
        "/web/..%2fapi%2fweb.py",
        "/web//etc/passwd",
        "/web/%2fetc%2fpasswd",
        "/web/",
        "/web/vendor",
        "/web/vendor/",
        "/web/nope.js",
        "/web/APP.JS",
    ],
)
async def test_only_the_page_files_are_reachable(client: httpx.AsyncClient, path: str) -> None:
    r = await client.get(path)
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_the_file_index_holds_only_plain_relative_names() -> None:
    names = set(web_files())
    assert {INDEX, "app.js", "app.css", "vendor/marked.esm.js", "vendor/purify.min.js"} <= names
    assert all(not name.startswith("/") and ".." not in name.split("/") for name in names)


async def test_the_page_is_open_without_a_key_but_the_api_is_not(secured_client: httpx.AsyncClient) -> None:
    page = await secured_client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert page.status_code == 200 and "<html" in page.text
    assert (await secured_client.get("/")).text == PLAIN_ROOT
    for name in web_files():
        assert (await secured_client.get(WEB_PREFIX + name)).status_code == 200, name
    models = await secured_client.get("/v1/models")
    assert models.status_code == 401
    assert (await secured_client.post("/api/show", json={"model": "fake"})).status_code == 401
    assert (await secured_client.get("/webhook")).status_code == 401  # the open prefix is /web/, not /web
    sneaking = await secured_client.get("/web/%2e%2e/v1/models")  # open by prefix, but no route beyond the files
    assert sneaking.status_code == 404 and "data" not in sneaking.json()


def referenced_files(html: str, script: str) -> set[str]:
    """The page files index.html names (src/href under /web/) and app.js imports (relative to /web/)."""
    names = {m.group(1) for m in re.finditer(r'(?:src|href)="/web/([^"]+)"', html)}
    names |= {m.group(1) for m in re.finditer(r'^import .* from "\./([^"]+)";$', script, re.MULTILINE)}
    return names


async def test_every_file_the_page_references_is_in_the_package(client: httpx.AsyncClient) -> None:
    html = (await client.get("/", headers={"Accept": "text/html"})).text
    script = (await client.get(WEB_PREFIX + "app.js")).text
    names = referenced_files(html, script)
    assert {"app.css", "app.js", "vendor/purify.min.js", "vendor/marked.esm.js"} <= names
    for name in names:
        assert name in web_files(), name
        assert (await client.get(WEB_PREFIX + name)).status_code == 200, name
    assert not re.search(r'(?:src|href)="(?:https?:)?//', html), "the page must work offline: no external URLs"


def test_every_vendored_library_has_its_licence_and_is_named_in_the_readme() -> None:
    files = web_files()
    readme = files["vendor/README.md"].read_text(encoding="utf-8")
    libraries = [name for name in files if name.startswith("vendor/") and name.endswith(".js")]
    assert libraries
    for name in libraries:
        stem = name.removeprefix("vendor/").split(".")[0]
        assert f"vendor/{stem}.LICENSE" in files, name
        assert f"`{name.removeprefix('vendor/')}`" in readme, name

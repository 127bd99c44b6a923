"""A tiny Hugging Face Hub look-alike on 127.0.0.1, enough for huggingface_hub 2.x `model_info`,
`list_repo_files`, `get_hf_file_metadata` and `hf_hub_download` (plain HTTP, no Xet).

Served routes (what the installed huggingface_hub asks for):

- `GET /api/models/{org}/{repo}` and `/api/models/{org}/{repo}/revision/{rev}` → `{id, sha, siblings}`;
  with `?blobs=true` each sibling carries `size`, `blobId` and, for LFS files, `lfs: {size, sha256, pointerSize}`.
- `GET /api/models/{org}/{repo}/tree/{rev}` → one page of `{type: "file", path, size, oid, lfs}` entries.
- `HEAD|GET /{org}/{repo}/resolve/{rev}/{filename}` → `X-Repo-Commit`, `ETag`, `Content-Length`.
  LFS files (`*.gguf`, `*.safetensors`, `tokenizer.model`) answer like the real hub: `302` to `/cdn/{sha256}` on
  a second port (another origin, like a CDN) with `X-Linked-Etag` and `X-Linked-Size`; other files are served
  directly with a git-blob ETag.
- `GET /cdn/{sha256}` → the bytes, honouring `Range: bytes=N-` with `206` and `Content-Range`.
- Unknown repo → `404` + `X-Error-Code: RepoNotFound`; unknown file → `404` + `X-Error-Code: EntryNotFound`;
  gated repo → `403` + `X-Error-Code: GatedRepo`.

Every request is recorded in `FakeHub.requests` (method, path, headers) so tests can assert on Range and auth.

`tiny_repository()` is a small safetensors repository to serve (config.json, a safetensors file written by hand,
tokenizer files, generation_config.json, and files a pull leaves out).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass(frozen=True, slots=True)
class Request:
    """One request the fake hub received."""

    method: str
    path: str
    headers: dict[str, str]


@dataclass(slots=True)
class FakeHub:
    """Repositories served as {"org/repo": {filename: bytes}}; `endpoint` is set once the server runs."""

    repos: dict[str, dict[str, bytes]]
    commit: str = COMMIT
    endpoint: str = ""
    cdn_endpoint: str = ""
    gated: frozenset[str] = frozenset()
    requests: list[Request] = field(default_factory=list)
    honours_range: bool = True
    """False: the CDN ignores `Range` and answers 200 with the whole file, as some servers do."""
    cut_after: int | None = None
    """Send at most this many bytes of a CDN file (a download that stops short, cleanly)."""
    listed_sizes: dict[str, int] = field(default_factory=dict)
    """Sizes the file listing reports instead of the real ones, by file name (a listing that disagrees)."""

    def is_lfs(self, filename: str) -> bool:
        """LFS files are served through a CDN redirect, like the real hub does for large files."""
        return filename.lower().endswith((".gguf", ".safetensors")) or filename == "tokenizer.model"

    def blob(self, sha256: str) -> bytes | None:
        """The bytes of any served file by their sha256."""
        for files in self.repos.values():
            for data in files.values():
                if hashlib.sha256(data).hexdigest() == sha256:
                    return data
        return None

    def requests_for(self, suffix: str, method: str = "GET") -> list[Request]:
        """Recorded requests whose path ends with `suffix`."""
        return [r for r in self.requests if r.method == method and r.path.endswith(suffix)]


def git_blob_sha1(data: bytes) -> str:
    """The git blob id of `data` (what the hub reports as ETag/blobId for non-LFS files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of `data`."""
    return hashlib.sha256(data).hexdigest()


@contextmanager
def serve_hub(repos: Mapping[str, Mapping[str, bytes]], *, gated: frozenset[str] = frozenset()) -> Iterator[FakeHub]:
    """Run a fake hub (and its "CDN", on a second port) on 127.0.0.1 for the duration of the `with` block.

    The CDN must be another origin: huggingface_hub follows same-origin redirects of HEAD /resolve itself.
    Repos in `gated` answer `403` + `X-Error-Code: GatedRepo` everywhere, as for a license not yet accepted.
    """
    hub = FakeHub(repos={repo: dict(files) for repo, files in repos.items()}, gated=gated)
    handler = type("Handler", (_Handler,), {"hub": hub})
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
    hub.endpoint, hub.cdn_endpoint = (f"http://127.0.0.1:{server.server_address[1]}" for server in servers)
    threads = [
        threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-hub", daemon=True) for server in servers
    ]
    for server, thread in zip(servers, threads, strict=True):
        server.daemon_threads = True
        thread.start()
    try:
        yield hub
    finally:
        for server, thread in zip(servers, threads, strict=True):
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        """Stay quiet; requests are recorded in `hub.requests` instead."""

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, *, head: bool) -> None:
        url = urlsplit(self.path)
        self.hub.requests.append(Request(self.command, url.path, {k.lower(): v for k, v in self.headers.items()}))
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        repo = "/".join(parts[2:4] if parts[:2] == ["api", "models"] else parts[:2])
        if repo in self.hub.gated:
            self._send(403, b"Access to this model is restricted", {"X-Error-Code": "GatedRepo"}, head=head)
            return
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            self._tree("/".join(parts[2:4]), head=head)
        elif parts[:2] == ["api", "models"] and len(parts) >= 4:
            self._model_info("/".join(parts[2:4]), with_blobs="blobs=true" in url.query.lower(), head=head)
        elif parts[:1] == ["cdn"] and len(parts) == 2:
            self._cdn(parts[1], head=head)
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._resolve("/".join(parts[:2]), "/".join(parts[4:]), head=head)
        else:
            self._send(404, b"not found", {}, head=head)

    def _model_info(self, repo: str, *, with_blobs: bool, head: bool) -> None:
        files = self.hub.repos.get(repo)
        if files is None:
            self._repo_not_found(head=head)
            return
        siblings = []
        for name, data in files.items():
            sibling: dict[str, object] = {"rfilename": name}
            if with_blobs:
                sibling |= {"size": self.hub.listed_sizes.get(name, len(data)), "blobId": git_blob_sha1(data)}
                if self.hub.is_lfs(name):
                    sibling["lfs"] = {"size": len(data), "sha256": sha256_hex(data), "pointerSize": 134}
            siblings.append(sibling)
        body = json.dumps({"id": repo, "modelId": repo, "sha": self.hub.commit, "siblings": siblings}).encode()
        self._send(200, body, {"Content-Type": "application/json"}, head=head)

    def _tree(self, repo: str, *, head: bool) -> None:
        """`list_repo_tree`/`list_repo_files`: every file, in one page (folders are not listed)."""
        files = self.hub.repos.get(repo)
        if files is None:
            self._repo_not_found(head=head)
            return
        entries = []
        for name, data in files.items():
            entry: dict[str, object] = {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
            if self.hub.is_lfs(name):
                entry["lfs"] = {"oid": sha256_hex(data), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, head=head)

    def _resolve(self, repo: str, filename: str, *, head: bool) -> None:
        files = self.hub.repos.get(repo)
        if files is None:
            self._repo_not_found(head=head)
            return
        data = files.get(filename)
        if data is None:
            headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": self.hub.commit}
            self._send(404, b"Entry not found", headers, head=head)
            return
        headers = {"X-Repo-Commit": self.hub.commit}
        if self.hub.is_lfs(filename):
            digest = sha256_hex(data)
            headers |= {
                "Location": f"{self.hub.cdn_endpoint}/cdn/{digest}",
                "ETag": f'"{git_blob_sha1(data)}"',
                "X-Linked-Etag": f'"{digest}"',
                "X-Linked-Size": str(len(data)),
            }
            self._send(302, b"", headers, head=head)
            return
        headers["ETag"] = f'"{git_blob_sha1(data)}"'
        self._send_bytes(data, headers, head=head)

    def _cdn(self, digest: str, *, head: bool) -> None:
        data = self.hub.blob(digest)
        if data is None:
            self._send(404, b"no such blob", {}, head=head)
            return
        if self.hub.cut_after is not None and not head:
            self._send(200, data[: self.hub.cut_after], {"ETag": f'"{digest}"'}, head=head)
            return
        self._send_bytes(data, {"ETag": f'"{digest}"'}, head=head)

    def _send_bytes(self, data: bytes, headers: dict[str, str], *, head: bool) -> None:
        """Serve `data`, or its tail for `Range: bytes=N-`."""
        headers = headers | {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        start = _range_start(self.headers.get("Range")) if self.hub.honours_range else None
        if start is None or head:
            self._send(200, data, headers, head=head)
        elif start >= len(data):
            self._send(416, b"", headers | {"Content-Range": f"bytes */{len(data)}"}, head=head)
        else:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self._send(206, data[start:], headers, head=head)

    def _repo_not_found(self, *, head: bool) -> None:
        self._send(404, b"Repository not found", {"X-Error-Code": "RepoNotFound"}, head=head)

    def _send(self, status: int, body: bytes, headers: dict[str, str], *, head: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)


def safetensors_bytes(tensors: Mapping[str, tuple[str, list[int]]], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors file of zero-filled tensors, {name: (dtype, shape)} with dtype "F32", "BF16", "F16" or "I64":
    8-byte little-endian header length, the JSON header (padded with spaces to 8 bytes), then the data."""
    widths = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = widths[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(offset)


TINY_TEMPLATE = (
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif -%}"
    "{%- for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor -%}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}"
)
TINY_PARAMETERS = 32 * 16 + 16 * 16 * 2 + 16
"""The parameter count of `tiny_repository()`'s weights: embeddings 32 x 16, two 16 x 16 layers, a norm of 16."""


def tiny_repository(*, shards: int = 1) -> dict[str, bytes]:
    """A tiny Llama-shaped safetensors repository, as a hub repo's files (never loaded by an engine).

    With `shards=2` the weights are split over `model-0000N-of-00002.safetensors` plus an index. Files a pull
    leaves out come along: README.md, .gitattributes, pytorch_model.bin, an image, an `original/` folder.
    """
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
              "num_hidden_layers": 2, "vocab_size": 32, "max_position_embeddings": 256, "dtype": "bfloat16"}
    tensors = {"model.embed_tokens.weight": ("BF16", [32, 16]), "model.layers.0.mlp.weight": ("BF16", [16, 16]),
               "model.layers.1.mlp.weight": ("BF16", [16, 16]), "model.norm.weight": ("F32", [16])}
    files = {
        "README.md": b"# tiny\n",
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
        "config.json": json.dumps(config, indent=1).encode(),
        "generation_config.json": json.dumps({"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05,
                                              "max_new_tokens": 64, "do_sample": True}).encode(),
        "tokenizer.json": json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}).encode(),
        "tokenizer_config.json": json.dumps({"chat_template": TINY_TEMPLATE, "eos_token": "</s>"}).encode(),
        "special_tokens_map.json": json.dumps({"eos_token": "</s>"}).encode(),
        "pytorch_model.bin": b"not kept",
        "logo.png": b"\x89PNG not kept",
        "original/params.json": b"{}",
    }
    if shards == 1:
        files["model.safetensors"] = safetensors_bytes(tensors, {"format": "pt"})
        return files
    names = list(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map: dict[str, str] = {}
    for index, half in enumerate(halves, 1):
        shard = f"model-{index:05d}-of-00002.safetensors"
        files[shard] = safetensors_bytes({name: tensors[name] for name in half})
        weight_map |= dict.fromkeys(half, shard)
    files["model.safetensors.index.json"] = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    return files


def _range_start(header: str | None) -> int | None:
    """The start of a `bytes=N-` range, the only form huggingface_hub sends; None when absent or other."""
    if header is None or not header.startswith("bytes=") or not header.endswith("-"):
        return None
    value = header[len("bytes=") : -1]
    return int(value) if value.isdigit() else None

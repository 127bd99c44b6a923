"""A stored model's manifest: the blobs it is made of and what its Modelfile added, checked when read back;
blob digests and their rule."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from lmserve.errors import InvalidRequest
from lmserve.store.names import ModelName
from lmserve.store.repository import check_relative_path

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}\Z")
"""A blob digest: `sha256:` and 64 lowercase hex digits (`\\Z`, so no trailing newline slips through)."""
SCHEMA_VERSION = 1


def check_digest(digest: str) -> str:
    """Return `digest` if it is `sha256:` + 64 lowercase hex digits; else raise InvalidRequest naming the rule."""
    if DIGEST_RE.match(digest):
        return digest
    hex_part = digest.removeprefix("sha256:")
    if not digest.startswith("sha256:"):
        rule = "a digest starts with 'sha256:'"
    elif len(hex_part) != 64:
        rule = f"'sha256:' is followed by exactly 64 hex digits, not {len(hex_part)} characters"
    else:
        rule = "the 64 hex digits are lowercase 0-9 and a-f only"
    raise InvalidRequest(f"invalid digest {digest[:80]!r}: {rule}", param="digest")


@dataclass(slots=True)
class Manifest:
    """One model: which blobs it is made of, and what its Modelfile added on top of the GGUF."""

    model: str
    """Blob digest of the GGUF weights; for a repository, of its config.json."""
    projector: str | None = None
    """Blob digest of an mmproj GGUF (vision projector)."""
    adapters: list[str] = field(default_factory=list)
    """Blob digests of LoRA GGUFs."""
    template: str | None = None
    """Go template text from a Modelfile; None = use the GGUF's own chat template."""
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[tuple[str, str]] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    parent: str = ""
    """The name this model was created FROM (details.parent_model)."""
    details: dict[str, Any] = field(default_factory=dict)
    """format, family, families, parameter_size, quantization_level."""
    modified_at: float = 0.0
    """Unix seconds; set by `Store.save`."""
    files: dict[str, str] = field(default_factory=dict)
    """A repository's files: relative path → blob digest (config.json's is `model`); empty for a GGUF model."""
    adapter_dirs: list[dict[str, str]] = field(default_factory=list)
    """PEFT LoRA directories over a repository (adapter_config.json + weights), each as a repository's `files`."""
    signature: dict[str, str] = field(default_factory=dict)
    """Its weights' verified signature (store/signatures.py): signed_by, verified_at, signature; {} when none."""

    @property
    def digests(self) -> list[str]:
        """Every blob digest this manifest refers to, once each: model, projector, adapters, repository files."""
        projector = [] if self.projector is None else [self.projector]
        folders = [digest for files in self.adapter_dirs for digest in files.values()]
        return list(dict.fromkeys([self.model, *projector, *self.adapters, *self.files.values(), *folders]))


@dataclass(slots=True)
class ModelEntry:
    """A stored model as listed: its name, manifest, total blob bytes and manifest digest."""

    name: ModelName
    manifest: Manifest
    size: int
    """Total bytes of its blobs."""
    digest: str
    """sha256 hex of the manifest file's bytes (like the local runner's model digest; no `sha256:` prefix)."""


def decode_manifest(raw: bytes) -> Manifest:
    """Parse and check a manifest file; ValueError or InvalidRequest on anything unexpected."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")

    def typed(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = data.get(key, default)
        if not isinstance(value, kind) or (isinstance(value, bool) and key == "modified_at"):
            raise ValueError(f"{key!r} has the wrong type")
        return value

    projector = typed("projector", (str, type(None)), None)
    adapters = typed("adapters", list, [])
    files = typed("files", dict, {})
    folders = typed("adapter_dirs", list, [])
    if not all(isinstance(digest, str) for digest in files.values()) or not all(
            isinstance(folder, dict) and all(isinstance(digest, str) for digest in folder.values())
            for folder in folders):
        raise ValueError("'files' and each of 'adapter_dirs' must map file names to digests")
    messages = typed("messages", list, [])
    licenses = typed("license", list, [])
    signature = typed("signature", dict, {})
    if not all(isinstance(value, str) for value in signature.values()):
        raise ValueError("'signature' must map names to strings")
    if not all(isinstance(m, list) and len(m) == 2 and all(isinstance(s, str) for s in m) for m in messages):
        raise ValueError("'messages' must be [role, content] pairs")
    if not all(isinstance(text, str) for text in [*adapters, *licenses]):
        raise ValueError("'adapters' and 'license' must be lists of strings")
    return Manifest(
        model=check_digest(typed("model", str, None)),
        projector=None if projector is None else check_digest(projector),
        adapters=[check_digest(adapter) for adapter in adapters],
        template=typed("template", (str, type(None)), None),
        system=typed("system", (str, type(None)), None),
        parameters=typed("parameters", dict, {}),
        messages=[(role, content) for role, content in messages],
        license=licenses,
        parent=typed("parent", str, ""),
        details=typed("details", dict, {}),
        modified_at=float(typed("modified_at", (int, float), 0.0)),
        files=_checked_files(files),
        adapter_dirs=[_checked_files(folder) for folder in folders],
        signature=signature,
    )


def _checked_files(files: dict[str, str]) -> dict[str, str]:
    return {check_relative_path(name): check_digest(digest) for name, digest in files.items()}

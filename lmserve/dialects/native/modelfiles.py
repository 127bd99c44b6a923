"""The body of /api/create as a Modelfile (from, files, adapters, template, system, parameters, messages, license), and
a model's parameters as /api/show's text."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from lmserve import options as opts
from lmserve.dialects.native import schemas as wire
from lmserve.errors import InvalidRequest
from lmserve.store.manifest import check_digest
from lmserve.store.modelfile import Modelfile
from lmserve.store.modelfile import parse as parse_modelfile


def to_modelfile(body: wire.CreateBody) -> Modelfile:
    """A Modelfile from /api/create: its `modelfile` text, or the `from`/`files` fields and the rest."""
    if body.modelfile:
        base = parse_modelfile(body.modelfile)
    else:
        source, projector = body.from_, None
        if source is None and body.files:
            ggufs = [digest for name, digest in body.files.items() if not name.lower().startswith("mmproj")]
            projectors = [digest for name, digest in body.files.items() if name.lower().startswith("mmproj")]
            if len(ggufs) != 1 or len(projectors) > 1:
                raise InvalidRequest("files must name exactly one model GGUF (and at most one mmproj* projector)",
                                     param="files")
            source = "@" + check_digest(ggufs[0])
            projector = "@" + check_digest(projectors[0]) if projectors else None
        if source is None:
            raise InvalidRequest("one of modelfile, from or files is required", param="from")
        base = Modelfile(from_=source, projector=projector)
    license = base.license if body.license is None else (
        [body.license] if isinstance(body.license, str) else list(body.license))
    return replace(
        base,
        adapters=[*base.adapters, *("@" + check_digest(digest) for digest in (body.adapters or {}).values())],
        template=base.template if body.template is None else body.template,
        system=base.system if body.system is None else body.system,
        parameters={**base.parameters, **{name: opts.parameter_from_json(name, value)
                                          for name, value in (body.parameters or {}).items()}},
        messages=[*base.messages, *((m.role, m.content or "") for m in body.messages or ())],
        license=license,
    )


def parameters_text(parameters: dict[str, Any]) -> str:
    rows = []
    for name, value in parameters.items():
        for item in value if isinstance(value, list) else [value]:
            text = json.dumps(item) if isinstance(item, str) else str(item).lower() if isinstance(item, bool) else item
            rows.append(f"{name:<30} {text}")
    return "\n".join(rows)

"""The store catalog's load plans: what makes a second engine instance, and what only binds another name to one."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.engine.protocol import Engine
from lmserve.service.catalog import StoreCatalog
from lmserve.service.precedence import Precedence
from lmserve.store.modelfile import Modelfile
from lmserve.store.store import Store
from lmserve.types import LoadOptions, RequestOptions
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lora import write_tiny_lora


def never_opened(path: Path, options: LoadOptions) -> Engine:
    raise AssertionError("planning must not load anything")


@pytest.fixture
def catalog(tmp_path: Path) -> StoreCatalog:
    weights = tmp_path / "base.gguf"
    write_tiny_llama(weights)
    write_tiny_lora(tmp_path / "lora.gguf", weights)
    catalog = StoreCatalog(Store(tmp_path / "store"), never_opened)
    catalog.create("base", Modelfile(from_=str(weights)))
    return catalog


@pytest.mark.parametrize(("modelfile", "shares"), [
    (Modelfile(from_="base", system="You are a pirate."), True),
    (Modelfile(from_="base", template="{{ .Prompt }}"), True),
    (Modelfile(from_="base", messages=[("user", "hi"), ("assistant", "hello")]), True),
    (Modelfile(from_="base", parameters={"temperature": 0.1, "stop": ["\n"]}), True),
    (Modelfile(from_="base", parameters={"num_ctx": 256}), False),
    (Modelfile(from_="base", adapters=["lora.gguf"]), True),  # llama.cpp applies it per request (issue 44)
])  # fmt: skip
def test_only_weights_projector_and_load_options_make_another_instance(
    catalog: StoreCatalog, tmp_path: Path, modelfile: Modelfile, shares: bool
) -> None:
    catalog.create("derived", modelfile, base_dir=tmp_path)
    precedence = Precedence()  # the load options a request without options gets
    derived = catalog.plan("derived:latest", precedence.load(catalog.settings("derived"), RequestOptions()))
    base = catalog.plan("base:latest", precedence.load(catalog.settings("base"), RequestOptions()))
    assert (derived.key == base.key) is shares
    assert derived.binding != base.binding  # each name binds its own settings
    assert len(catalog.settings("derived").adapters) == len(modelfile.adapters)  # its requests carry its adapter


def test_a_model_created_again_changes_its_binding_not_its_instance(catalog: StoreCatalog) -> None:
    catalog.create("pirate", Modelfile(from_="base", system="You are a pirate."))
    before = catalog.plan("pirate:latest", LoadOptions())
    catalog.create("pirate", Modelfile(from_="base", system="You are a poet."))
    after = catalog.plan("pirate:latest", LoadOptions())
    assert after.key == before.key and after.binding != before.binding

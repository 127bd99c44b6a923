"""LoRA adapters registered by name and picked per request (lmserve/service/adapters.py), over a store catalog of a
tiny GGUF and its adapters (nothing is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmserve.errors import InvalidRequest, ModelNotFound
from lmserve.service.adapters import LoraRegistry
from lmserve.service.catalog import StoreCatalog
from lmserve.service.precedence import Precedence
from lmserve.store.modelfile import Modelfile
from lmserve.store.store import Store
from lmserve.types import LoadOptions, LoraRef, RequestOptions, SamplingParams
from tests.tiny_gguf import write_tiny_llama
from tests.tiny_lora import write_tiny_lora


def never_opened(*_: object) -> None:
    raise AssertionError("nothing is loaded here")


@pytest.fixture
def registry(tmp_path: Path) -> LoraRegistry:
    weights = write_tiny_llama(tmp_path / "base.gguf")
    for seed in (1, 2):
        write_tiny_lora(tmp_path / f"lora{seed}.gguf", weights, seed=seed)
    catalog = StoreCatalog(Store(tmp_path / "store"), never_opened)  # type: ignore[arg-type]
    catalog.create("base", Modelfile(from_=str(weights)))
    registry = LoraRegistry(catalog, "base:latest")
    registry.register("one", str(tmp_path / "lora1.gguf"))
    registry.register("two", str(tmp_path / "lora2.gguf"))
    return registry


def test_a_registered_adapter_is_a_model_over_the_base_carrying_its_file(registry: LoraRegistry) -> None:
    entries = registry.entries()
    assert [(entry.id, entry.name, entry.scale) for entry in entries] == [(0, "one", 0.0), (1, "two", 0.0)]
    settings = registry._catalog.settings("one")
    assert [adapter.path for adapter in settings.adapters] == [entries[0].path]  # the store's copy
    assert settings.adapters[0].name == "one"
    catalog = registry._catalog
    assert catalog.plan("one:latest", LoadOptions()).key == catalog.plan("base:latest", LoadOptions()).key  # shared


def test_a_request_picks_by_id_or_name_and_an_unknown_one_is_a_400(registry: LoraRegistry) -> None:
    [one, two] = registry.entries()
    assert [(a.path, a.scale) for a in registry.resolve((LoraRef(id=1, scale=0.5), LoraRef(name="one")))] == \
        [(two.path, 0.5), (one.path, 1.0)]
    for ref, reason in ((LoraRef(id=5), "no LoRA adapter has id 5"), (LoraRef(name="base"), "is no LoRA adapter"),
                        (LoraRef(name="nothing"), "is no LoRA adapter"), (LoraRef(), "needs an id or a name")):
        with pytest.raises(InvalidRequest, match=reason):
            registry.resolve((ref,))


def test_global_scales_apply_to_the_bases_plain_requests_only(registry: LoraRegistry) -> None:
    precedence = Precedence(loras=registry)
    base, one = registry._catalog.settings("base"), registry._catalog.settings("one")
    assert precedence.sampling(base, RequestOptions(), SamplingParams()).adapters == ()
    registry.set_scales({1: 0.25})
    [applied] = precedence.sampling(base, RequestOptions(), SamplingParams()).adapters
    assert (applied.path, applied.scale) == (registry.entries()[1].path, 0.25)
    assert precedence.sampling(one, RequestOptions(), SamplingParams()).adapters == one.adapters  # its own
    picked = precedence.sampling(one, RequestOptions(lora=()), SamplingParams()).adapters
    assert picked == ()  # an empty pick: none at all
    with pytest.raises(InvalidRequest, match="no LoRA adapter has id 7"):
        registry.set_scales({7: 1.0})


def test_unregistering_deletes_the_model_and_keeps_the_other_ids(registry: LoraRegistry) -> None:
    registry.unregister("one")
    assert [(entry.id, entry.name) for entry in registry.entries()] == [(1, "two")]
    with pytest.raises(ModelNotFound):
        registry._catalog.settings("one")
    with pytest.raises(ModelNotFound):
        registry.unregister("one")
    with pytest.raises(InvalidRequest, match="is loaded already"):
        registry.register("two", registry.entries()[0].path)

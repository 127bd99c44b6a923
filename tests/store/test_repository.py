"""Spec for lmserve.store.repository (which files of a Hugging Face repository are kept, the facts `show` tells),
and for safetensors repositories in the store catalog: create FROM a directory, list, show, plan."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from lmserve import options as opts
from lmserve.engine.factory import engine_of
from lmserve.engine.protocol import Engine
from lmserve.engine.vllm.vision import vision_support_missing
from lmserve.errors import InvalidRequest
from lmserve.service.catalog import StoreCatalog
from lmserve.store import repository
from lmserve.store.modelfile import Modelfile
from lmserve.store.store import Store
from lmserve.types import LoadOptions
from tests.hub import TINY_PARAMETERS, TINY_TEMPLATE, safetensors_bytes, tiny_repository
from tests.tiny_gguf import write_tiny_llama


def write_repository(folder: Path, files: dict[str, bytes] | None = None) -> Path:
    """Write a repository's files (default: `tiny_repository()`) into `folder`."""
    for name, data in (tiny_repository() if files is None else files).items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return folder


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return write_repository(tmp_path / "Tiny-Llama")


# ---- which files are kept ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filenames", "kept"),
    [
        (list(tiny_repository()), ["config.json", "generation_config.json", "model.safetensors",
                                   "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]),
        (list(tiny_repository(shards=2)), ["config.json", "generation_config.json",
                                           "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                           "model.safetensors.index.json", "special_tokens_map.json",
                                           "tokenizer.json", "tokenizer_config.json"]),
        (["model.safetensors", "config.json", "chat_template.jinja", "tokenizer.model", "merges.txt", "vocab.txt",
          "qwen.tiktoken", "model.onnx", "model.gguf", "pytorch_model.bin", "model.pt", "modeling_x.py"],
         ["config.json", "chat_template.jinja", "merges.txt", "model.safetensors", "qwen.tiktoken",
          "tokenizer.model", "vocab.txt"]),
        (["config.json", "consolidated.safetensors", "model.safetensors", "params.json"],
         ["config.json", "model.safetensors", "params.json"]),  # Mistral's duplicate weights are left out
        (["config.json", "consolidated.safetensors"], ["config.json", "consolidated.safetensors"]),
        (["config.json", "model.safetensors", "onnx/model.safetensors", ".hidden.json"],
         ["config.json", "model.safetensors"]),
    ],
)  # fmt: skip
def test_repository_files_keeps_weights_configs_and_tokenizer(filenames: list[str], kept: list[str]) -> None:
    assert repository.repository_files(filenames) == kept


@pytest.mark.parametrize("filenames", [[], ["config.json"], ["model.safetensors"], ["config.json", "model.bin"],
                                       ["sub/config.json", "sub/model.safetensors"]])
def test_a_repository_needs_config_and_safetensors(filenames: list[str]) -> None:
    with pytest.raises(InvalidRequest) as info:
        repository.repository_files(filenames)
    assert (info.value.status, info.value.code) == (400, "not_a_repository")


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../x", "a/../b", "a//b", "./a", "a\\b", "a/", "x\0y"])
def test_unsafe_file_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidRequest):
        repository.check_relative_path(name)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ([], "./d is not a model: it has no config.json and no .gguf file (a Hugging Face repository holds "
             "config.json, *.safetensors weights and tokenizer files; a GGUF model is one .gguf file)"),
        (["README.md", "model.safetensors", "tokenizer.json"], "./d is not a model: it has no config.json and no"),
        (["b.gguf", "a.Q4_K_M.gguf", "README.md"],
         "./d is not a model: it has no config.json (a Hugging Face repository's); serve one of its GGUF files: "
         "./d/a.Q4_K_M.gguf, ./d/b.gguf"),
        (["config.json", "tokenizer.json"],
         "./d is not a model lmserve can serve: it has a config.json but no *.safetensors weights"),
        (["config.json", "pytorch_model.bin", "tokenizer.json"],
         "./d is not a model lmserve can serve: it has a config.json but no *.safetensors weights (not "
         "pytorch_model.bin: lmserve reads safetensors weights only)"),
        (["config.json", "model.safetensors", "tokenizer_config.json"],
         "./d is not a model lmserve can serve: it has config.json and weights but no tokenizer (tokenizer.json, "
         "tokenizer.model, tekken.json, vocab.json, vocab.txt or a *.tiktoken file)"),
    ],
)  # fmt: skip
def test_a_directory_that_is_not_a_model_is_told_what_it_lacks(tmp_path: Path, files: list[str],
                                                               message: str) -> None:
    write_repository(tmp_path, dict.fromkeys(files, b"{}"))
    assert (repository.not_a_model(tmp_path, "./d") or "").startswith(message)


@pytest.mark.parametrize("tokenizer", ["tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json", "vocab.txt",
                                       "qwen.tiktoken"])
def test_a_whole_repository_lacks_nothing(tmp_path: Path, tokenizer: str) -> None:
    write_repository(tmp_path, dict.fromkeys(["config.json", "model.safetensors", tokenizer], b"{}"))
    assert repository.not_a_model(tmp_path, "./d") is None


def test_local_files_lists_what_is_kept(repo: Path) -> None:
    files = repository.local_files(repo)
    assert next(iter(files)) == "config.json"
    assert files["model.safetensors"] == repo / "model.safetensors"
    assert "README.md" not in files and "pytorch_model.bin" not in files


# ---- facts ----------------------------------------------------------------------------------------------------


def test_parameters_are_counted_from_the_safetensors_headers(tmp_path: Path) -> None:
    one = write_repository(tmp_path / "one")
    two = write_repository(tmp_path / "two", tiny_repository(shards=2))
    assert repository.parameter_count(one) == repository.parameter_count(two) == TINY_PARAMETERS


def test_the_hand_written_safetensors_file_reads_like_the_library_writes(tmp_path: Path) -> None:
    numpy = pytest.importorskip("numpy")
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "lib.safetensors"
    safetensors_numpy.save_file({"a": numpy.zeros((3, 5), numpy.float32), "b": numpy.zeros(7, numpy.int64)}, path)
    assert repository.safetensors_parameters(path) == 3 * 5 + 7
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(safetensors_bytes({"a": ("F32", [3, 5]), "b": ("I64", [7])}))
    assert {k: v.shape for k, v in safetensors_numpy.load_file(mine).items()} == {"a": (3, 5), "b": (7,)}


@pytest.mark.parametrize(
    "data",
    [b"", b"\x01", struct.pack("<Q", 2**40) + b"{}", struct.pack("<Q", 4) + b"nope", struct.pack("<Q", 2) + b"[]",
     struct.pack("<Q", 30) + b'{"a": {"shape": [2, -1]}}    '],
)  # fmt: skip
def test_an_unreadable_header_counts_nothing(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    assert repository.safetensors_parameters(path) == 0


@pytest.mark.parametrize(
    ("num_params", "label"),
    [(0, ""), (999, "999"), (TINY_PARAMETERS, "1K"), (3_306_688, "3.31M"), (8_000_000, "8M"), (134_515_008, "134.52M"),
     (1_170_340_608, "1.2B"), (8_000_000_000, "8B")],
)
def test_parameter_size_labels(num_params: int, label: str) -> None:
    assert repository.parameter_size(num_params) == label


@pytest.mark.parametrize(
    ("config", "level"),
    [
        ({"dtype": "bfloat16"}, "BF16"),
        ({"torch_dtype": "float16"}, "F16"),
        ({"torch_dtype": "torch.float32"}, "F32"),
        ({"text_config": {"dtype": "bfloat16"}}, "BF16"),
        ({"dtype": "bfloat16", "quantization_config": {"quant_method": "awq"}}, "AWQ"),
        ({"dtype": "int8"}, "INT8"),
        ({"dtype": "bfloat16", "quantization": {"group_size": 64, "bits": 4, "mode": "affine"}}, "Q4"),  # MLX's
        ({}, ""),
    ],
)
def test_quantization_level_is_the_quant_method_or_the_dtype(config: dict[str, object], level: str) -> None:
    assert repository.quantization_level(config) == level


def test_details(repo: Path) -> None:
    assert repository.details(repo, parent="x:latest") == {
        "parent_model": "x:latest", "format": "safetensors", "family": "llama", "families": ["llama"],
        "parameter_size": "1K", "quantization_level": "BF16",
    }  # fmt: skip


def test_model_info_names_config_keys_like_gguf_metadata(repo: Path) -> None:
    info = repository.model_info(repo)
    assert info["general.architecture"] == "llama"
    assert info["general.parameter_count"] == TINY_PARAMETERS
    assert info["llama.hidden_size"] == 16
    assert info["llama.context_length"] == 256
    json.dumps(info)


@pytest.mark.parametrize(
    ("files", "template"),
    [
        ({"chat_template.jinja": "J", "tokenizer_config.json": '{"chat_template": "T"}'}, "J"),
        ({"tokenizer_config.json": '{"chat_template": "T"}'}, "T"),
        ({"tokenizer_config.json": '{"chat_template": [{"name": "tool_use", "template": "U"}, '
                                   '{"name": "default", "template": "D"}]}'}, "D"),
        ({"tokenizer_config.json": '{"chat_template": [{"name": "rag", "template": "R"}]}'}, "R"),
        ({"chat_template.json": '{"chat_template": "P"}'}, "P"),
        ({"tokenizer_config.json": "{not json"}, ""),
        ({}, ""),
    ],
)  # fmt: skip
def test_chat_template_sources(tmp_path: Path, files: dict[str, str], template: str) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert repository.chat_template(tmp_path) == template


@pytest.mark.parametrize(("config", "vision"), [({}, False), ({"vision_config": {"model_type": "siglip"}}, True)])
def test_a_vision_config_makes_a_vision_model(config: dict[str, object], vision: bool) -> None:
    assert repository.has_vision(config) is vision


@pytest.mark.parametrize(
    ("generation_config", "layer"),
    [
        ({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
          "max_new_tokens": 64, "do_sample": True},
         {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repeat_penalty": 1.05}),
        ({"temperature": -1, "top_p": 7}, {}),  # out of range: recommends nothing
        ({"bos_token_id": 1}, {}),
    ],
)  # fmt: skip
def test_generation_config_becomes_the_model_defaults_layer(generation_config: dict[str, object],
                                                            layer: dict[str, object]) -> None:
    assert opts.model_defaults(generation_config, opts.GENERATION_CONFIG_KEYS) == layer


# ---- in the store catalog -------------------------------------------------------------------------------------


def never_opened(path: Path, options: LoadOptions) -> Engine:
    raise AssertionError("planning must not load anything")


@pytest.fixture
def catalog(tmp_path: Path) -> StoreCatalog:
    return StoreCatalog(Store(tmp_path / "store"), never_opened)


def test_create_from_a_directory_stores_its_files_as_blobs(catalog: StoreCatalog, repo: Path) -> None:
    catalog.create("tiny", Modelfile(from_=str(repo)))

    entry = catalog.store.find("tiny")
    manifest = entry.manifest
    assert sorted(manifest.files) == repository.repository_files(tiny_repository())
    assert manifest.model == manifest.files["config.json"]
    assert entry.size == sum(len(data) for name, data in tiny_repository().items() if name in manifest.files)
    directory = catalog.store.model_path(manifest)
    assert engine_of(directory).name == "vllm"
    assert (directory / "model.safetensors").read_bytes() == (repo / "model.safetensors").read_bytes()


@pytest.mark.parametrize("from_", ["./Tiny-Llama", "Tiny-Llama", "Tiny-Llama/"])
def test_create_from_a_directory_relative_to_the_modelfile(catalog: StoreCatalog, repo: Path, from_: str) -> None:
    catalog.create("tiny", Modelfile(from_=from_), base_dir=repo.parent)
    assert catalog.store.find("tiny").manifest.files


def test_list_and_show_a_repository(catalog: StoreCatalog, repo: Path) -> None:
    catalog.create("tiny", Modelfile(from_=str(repo)))

    [listing] = catalog.listing()
    assert listing.details["format"] == "safetensors"
    assert listing.details["family"] == "llama"
    assert listing.details["quantization_level"] == "BF16"
    shown = catalog.describe("tiny:latest")
    assert shown.template == TINY_TEMPLATE
    assert shown.capabilities == ["completion", "tools", "rerank"]
    assert shown.model_info["general.parameter_count"] == TINY_PARAMETERS
    assert shown.modelfile.startswith(f"FROM {catalog.store.model_path(catalog.store.find('tiny').manifest)}")
    assert not catalog.has_vision("tiny:latest")
    assert catalog.model_defaults("tiny:latest") == {"temperature": 0.6, "top_p": 0.9, "repeat_penalty": 1.05}


def test_a_vision_repository_sees_images(catalog: StoreCatalog, tmp_path: Path) -> None:
    files = tiny_repository()
    files["config.json"] = json.dumps({"model_type": "lfm2_vl", "vision_config": {"model_type": "siglip2"}}).encode()
    catalog.create("vl", Modelfile(from_=str(write_repository(tmp_path / "vl", files))))
    assert catalog.has_vision("vl:latest")
    # show lists "vision" where the vLLM engine can serve its images (its image processor needs torchvision)
    servable = vision_support_missing({"vision_config": {}}) is None
    assert ("vision" in catalog.describe("vl:latest").capabilities) == servable


def test_template_system_and_parameters_over_a_repository(catalog: StoreCatalog, repo: Path) -> None:
    catalog.create("tiny", Modelfile(from_=str(repo)))
    catalog.create("pirate", Modelfile(from_="tiny", template="{{ .Prompt }}", system="Arr.",
                                       parameters={"temperature": 0.1}))

    shown = catalog.describe("pirate:latest")
    assert (shown.template, shown.system) == ("{{ .Prompt }}", "Arr.")
    # show's parameters: the Modelfile's over the repository's generation_config.json recommendation
    assert shown.parameters == {"temperature": 0.1, "top_p": 0.9, "repeat_penalty": 1.05}
    assert shown.listing.details["parent_model"] == "tiny:latest"
    assert shown.listing.details["format"] == "safetensors"
    assert catalog.parameters("pirate:latest") == {"temperature": 0.1}
    base, derived = catalog.plan("tiny:latest", LoadOptions()), catalog.plan("pirate:latest", LoadOptions())
    assert base.key == derived.key  # the same files: one engine instance
    assert base.key.weights == str(catalog.store.model_path(catalog.store.find("tiny").manifest))


@pytest.mark.parametrize(
    ("modelfile", "quantize", "mentions"),
    [
        (Modelfile(from_="REPO", projector="mmproj.gguf"), False, "projector"),
        (Modelfile(from_="REPO"), True, "quantize"),
    ],
)
def test_gguf_only_directives_over_a_repository_are_refused(
    catalog: StoreCatalog, repo: Path, modelfile: Modelfile, quantize: bool, mentions: str
) -> None:
    modelfile.from_ = str(repo)
    with pytest.raises(InvalidRequest) as info:
        catalog.create("x", modelfile, quantize=(lambda path: path) if quantize else None)
    assert info.value.status == 400
    assert mentions in info.value.message and "vLLM" in info.value.message
    assert catalog.listing() == []


def write_peft(folder: Path, rows: int = 16) -> Path:
    """A PEFT LoRA directory of rank 4 over the tiny repository's model.layers.0.mlp (another model's: `rows` != 16)."""
    prefix = "base_model.model.model.layers.0.mlp"
    return write_repository(folder, {
        "adapter_config.json": json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}).encode(),
        "adapter_model.safetensors": safetensors_bytes({f"{prefix}.lora_A.weight": ("F32", [4, 16]),
                                                        f"{prefix}.lora_B.weight": ("F32", [rows, 4])}, {}),
    })


def test_a_peft_adapter_over_a_repository_is_a_model_sharing_its_instance(catalog: StoreCatalog, repo: Path,
                                                                          tmp_path: Path) -> None:
    catalog.create("tiny", Modelfile(from_=str(repo)))
    catalog.create("tuned", Modelfile(from_="tiny", adapters=[str(write_peft(tmp_path / "peft"))]))
    (adapter,) = catalog.settings("tuned").adapters  # it rides on each request
    assert (Path(adapter.path) / "adapter_config.json").is_file() and adapter.name == "tuned"
    assert catalog.plan("tuned:latest", LoadOptions()).key == catalog.plan("tiny:latest", LoadOptions()).key
    shown = catalog.describe("tuned:latest")
    assert shown.listing.parent == "tiny:latest" and shown.model_info["lora.ranks"] == [4]
    assert f"ADAPTER {adapter.path}" in shown.modelfile
    catalog.store.gc()
    assert (Path(catalog.settings("tuned").adapters[0].path) / "adapter_model.safetensors").is_file()
    with pytest.raises(InvalidRequest, match=r"does not fit this model: model\.layers\.0\.mlp"):
        catalog.create("wrong", Modelfile(from_="tiny", adapters=[str(write_peft(tmp_path / "other", rows=32))]))


def test_a_peft_adapter_uploaded_as_blobs_is_told_apart_by_content(catalog: StoreCatalog, repo: Path,
                                                                    tmp_path: Path) -> None:
    """The native /api/create's `adapters` over a repository: the two files of a PEFT adapter, uploaded as blobs."""
    catalog.create("tiny", Modelfile(from_=str(repo)))
    folder = write_peft(tmp_path / "peft")
    digests = [catalog.store.import_file(folder / name)
               for name in ("adapter_model.safetensors", "adapter_config.json")]
    catalog.create("tuned", Modelfile(from_="tiny", adapters=[f"@{digest}" for digest in digests]))
    assert catalog.describe("tuned:latest").model_info["lora.ranks"] == [4]
    with pytest.raises(InvalidRequest, match="give both, and one adapter per model"):
        catalog.create("half", Modelfile(from_="tiny", adapters=[f"@{digests[0]}"]))


def test_a_directory_without_config_is_refused(catalog: StoreCatalog, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequest, match=r"without a config\.json"):
        catalog.create("x", Modelfile(from_=str(tmp_path / "empty")))


def test_a_directory_without_safetensors_is_refused(catalog: StoreCatalog, tmp_path: Path) -> None:
    write_repository(tmp_path / "bin", {"config.json": b"{}", "pytorch_model.bin": b"x"})
    with pytest.raises(InvalidRequest) as info:
        catalog.create("x", Modelfile(from_=str(tmp_path / "bin")))
    assert info.value.code == "not_a_repository"


def test_gguf_models_are_untouched(catalog: StoreCatalog, tmp_path: Path) -> None:
    weights = write_tiny_llama(tmp_path / "tiny.gguf")
    catalog.create("g", Modelfile(from_=str(weights)))
    manifest = catalog.store.find("g").manifest
    assert manifest.files == {}
    assert catalog.store.model_path(manifest) == catalog.store.blob_path(manifest.model)
    assert catalog.describe("g:latest").listing.details["format"] == "gguf"
    assert not (catalog.store.root / "repos").exists()

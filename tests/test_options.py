"""The options table: each option in each dialect and the Modelfile, the precedence of the four layers, refusals."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from lmserve import options
from lmserve.errors import InvalidRequest
from lmserve.options import TABLE
from lmserve.types import LoadOptions, SamplingParams

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
LOAD_FIELDS = {f.name for f in fields(LoadOptions)}


@pytest.mark.parametrize("option", TABLE.values(), ids=lambda o: o.name)
def test_every_option_sets_a_real_field_of_its_lifetime_or_says_why_not(option: options.Option) -> None:
    if option.field is None:
        assert option.help  # the reason it is refused, or ignored
        assert not option.ignored or option.help.startswith("ignored: ")
    else:
        assert option.field in (SAMPLING_FIELDS if option.lifetime == "sampling" else LOAD_FIELDS)
    assert option.native or option.openai  # some route takes it


NATIVE: list[tuple[dict[str, Any], dict[str, Any]]] = [
    # (native options, SamplingParams / LoadOptions fields they set)
    ({"temperature": 0}, {"temperature": 0.0}),
    ({"top_k": 40}, {"top_k": 40}),
    ({"top_k": -1}, {"top_k": 0}),
    ({"top_p": 0.5}, {"top_p": 0.5}),
    ({"min_p": 0.05}, {"min_p": 0.05}),
    ({"typical_p": 0.7}, {"typical_p": 0.7}),
    ({"repeat_penalty": 1.2}, {"repeat_penalty": 1.2}),
    ({"repeat_last_n": -1}, {"repeat_last_n": -1}),
    ({"presence_penalty": 0.5, "frequency_penalty": -0.5}, {"presence_penalty": 0.5, "frequency_penalty": -0.5}),
    ({"mirostat": 2, "mirostat_tau": 4.0, "mirostat_eta": 0.2}, {"mirostat": 2, "mirostat_tau": 4.0,
                                                                 "mirostat_eta": 0.2}),
    ({"seed": 7}, {"seed": 7}),
    ({"stop": "x"}, {"stop": ["x"]}),
    ({"stop": ["a", "b"]}, {"stop": ["a", "b"]}),
    ({"num_predict": 12}, {"max_tokens": 12}),
    ({"num_predict": -1}, {"max_tokens": None}),
    ({"num_predict": 12.0}, {"max_tokens": 12}),
    ({"temperature": None}, {}),
    ({"tfs_z": 1.0, "penalize_newline": False, "numa": False, "f16_kv": True}, {}),  # neutral values of refused ones
    ({"num_ctx": 1024}, {"num_ctx": 1024}),
    ({"num_batch": 64}, {"num_batch": 64}),
    ({"num_gpu": -1}, {"num_gpu_layers": -1}),
    ({"main_gpu": 1}, {"main_gpu": 1}),
    ({"use_mmap": False}, {"use_mmap": False}),
    ({"use_mlock": True}, {"use_mlock": True}),
    ({"num_thread": 2}, {"num_threads": 2}),
    ({"num_thread": 0}, {"num_threads": None}),
]  # fmt: skip


@pytest.mark.parametrize(("given", "expected"), NATIVE)
def test_native_options(given: dict[str, Any], expected: dict[str, Any]) -> None:
    layer = options.from_native(given)
    sampling = options.sampling(layer)
    load = options.load_options(LoadOptions(), layer)
    for name, value in expected.items():
        assert getattr(sampling if name in SAMPLING_FIELDS else load, name) == value, name
    changed = {f for f in SAMPLING_FIELDS if getattr(sampling, f) != getattr(SamplingParams(), f)}
    changed |= {f for f in LOAD_FIELDS if getattr(load, f) != getattr(LoadOptions(), f)}
    assert changed <= set(expected)


OPENAI: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"temperature": 0.5, "top_p": 0.9, "seed": 3}, {"temperature": 0.5, "top_p": 0.9, "seed": 3}),
    ({"repetition_penalty": 1.3}, {"repeat_penalty": 1.3}),
    ({"repeat_penalty": 1.1, "repetition_penalty": 1.3}, {"repeat_penalty": 1.1}),
    ({"max_tokens": 7, "max_completion_tokens": 3}, {"max_tokens": 3}),
    ({"logit_bias": {"15": -100, "7": 2.5}}, {"logit_bias": {15: -100.0, 7: 2.5}}),
    ({"ignore_eos": True}, {"ignore_eos": True}),
    ({"typical_p": 0.8, "mirostat": 1}, {"typical_p": 0.8, "mirostat": 1}),  # llama.cpp's extra fields
    ({"n": 1, "logprobs": False, "top_logprobs": 0, "best_of": 1, "user": "u", "store": True}, {}),
]  # fmt: skip


@pytest.mark.parametrize(("body", "expected"), OPENAI)
def test_openai_fields(body: dict[str, Any], expected: dict[str, Any]) -> None:
    params = options.sampling(options.from_openai(body))
    for name in SAMPLING_FIELDS:
        assert getattr(params, name) == expected.get(name, getattr(SamplingParams(), name)), name


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    # (dialect, what is sent, the param named, words of the message)
    ("native", {"num_keep": "4"}, "num_keep", "must be an integer"),
    ("native", {"tfs_z": 0.9}, "tfs_z", "not supported"),
    ("native", {"numa": True}, "numa", "not supported"),
    ("native", {"f16_kv": False}, "f16_kv", "float32"),
    ("native", {"temprature": 0.5}, "temprature", "unknown option 'temprature'"),
    ("native", {"logit_bias": {"1": 1}}, "logit_bias", "on the OpenAI routes (/v1) only"),  # Open WebUI: ""
    ("native", {"temperature": "hot"}, "temperature", "must be a number"),
    ("native", {"temperature": -0.1}, "temperature", "at least 0"),
    ("native", {"top_p": 0}, "top_p", "above 0"),
    ("native", {"top_p": 1.5}, "top_p", "at most 1"),
    ("native", {"typical_p": 2}, "typical_p", "at most 1"),
    ("native", {"top_k": 1.5}, "top_k", "an integer"),
    ("native", {"top_k": True}, "top_k", "an integer"),
    ("native", {"use_mmap": "yes"}, "use_mmap", "true or false"),
    ("native", {"stop": [1]}, "stop", "string"),
    ("native", {"num_ctx": 0}, "num_ctx", "at least 1"),
    ("native", {"num_batch": 10**6}, "num_batch", "at most 8192"),
    ("native", {"mirostat": 3}, "mirostat", "at most 2"),
    ("openai", {"n": 2}, "n", "several choices (n > 1) are for /v1/chat/completions"),
    ("openai", {"best_of": 3}, "best_of", "one completion"),
    ("openai", {"num_ctx": 4096}, "num_ctx", "load-time option"),
    ("openai", {"low_vram": True}, "low_vram", "load-time option"),
    ("openai", {"logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ("openai", {"logit_bias": {"1": 101}}, "logit_bias", "out of range"),
    ("openai", {"typical_p": 0}, "typical_p", "above 0"),
]  # fmt: skip


def test_draft_num_predict_is_the_local_runners_name_of_draft_max() -> None:
    assert options.sampling(options.from_native({"draft_num_predict": 3})).draft_max == 3
    assert options.sampling(options.from_parameters({"draft_num_predict": 0})).draft_max == 0
    with pytest.raises(InvalidRequest, match="at most 64"):
        options.from_native({"draft_num_predict": 65})


@pytest.mark.parametrize("sent", [{"num_keep": 24}, {"num_keep": 24.0, "low_vram": True}, {"logits_all": False}])
def test_options_that_change_nothing_are_taken_and_set_nothing(sent: dict[str, Any]) -> None:
    assert options.from_native(sent) == {}
    assert options.from_parameters(sent) == {}
    assert options.parse_parameter("num_keep", "24") == 24


@pytest.mark.parametrize(("dialect", "given", "param", "words"), REFUSED)
def test_refusals_name_the_option(dialect: str, given: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        options.from_native(given) if dialect == "native" else options.from_openai(given)
    assert caught.value.param == param
    assert words in caught.value.message


MODELFILE: list[tuple[str, str, object]] = [
    ("temperature", "0.7", 0.7), ("top_k", "+3", 3), ("use_mmap", "f", False), ("stop", "###", "###"),
    ("typical_p", "1", 1.0), ("main_gpu", "0", 0), ("tfs_z", "1", 1.0),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "value"), MODELFILE)
def test_modelfile_parameters_are_typed_by_the_table(name: str, text: str, value: object) -> None:
    assert options.parse_parameter(name, text) == value


@pytest.mark.parametrize(("name", "text", "words"), [
    ("tfs_z", "0.5", "tail-free"), ("top_p", "0", "above 0"), ("seed", "x", "needs int"),
    ("logit_bias", "{}", "unknown parameter"), ("foo", "1", "unknown parameter 'foo'"),
])  # fmt: skip
def test_modelfile_refusals_name_the_parameter(name: str, text: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        options.parse_parameter(name, text)
    assert caught.value.param == name and words in caught.value.message


# ---- precedence ------------------------------------------------------------------------------------------------

REQUEST = {"temperature": 0.1}
MODELFILE_LAYER = {"temperature": 0.2, "top_k": 20}
MODEL = {"temperature": 0.3, "top_k": 30, "top_p": 0.5}
SERVER = {"temperature": 0.4, "top_k": 40, "top_p": 0.6, "min_p": 0.07}


@pytest.mark.parametrize(("layers", "expected"), [
    ((REQUEST, MODELFILE_LAYER, MODEL, SERVER), (0.1, 20, 0.5, 0.07)),
    (({}, MODELFILE_LAYER, MODEL, SERVER), (0.2, 20, 0.5, 0.07)),
    (({}, {}, MODEL, SERVER), (0.3, 30, 0.5, 0.07)),
    (({}, {}, {}, SERVER), (0.4, 40, 0.6, 0.07)),
    (({}, {}, {}, {}), (0.8, 0, 1.0, 0.0)),
])  # fmt: skip
def test_request_over_modelfile_over_model_over_server(layers: tuple[options.Layer, ...],
                                                      expected: tuple[float, int, float, float]) -> None:
    params = options.sampling(*layers)
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == expected


def test_the_request_goes_over_the_resolved_defaults_which_stay_unchanged() -> None:
    defaults = options.sampling({"stop": ["<end>"]}, options.server_defaults("native"))
    params = options.sampling(options.from_native({"temperature": 0.5}), base=defaults)
    assert (params.temperature, params.top_k, params.stop) == (0.5, 40, ["<end>"])
    assert defaults.temperature == 0.8 and params.stop is not defaults.stop


def test_load_time_options_over_the_servers() -> None:
    server = LoadOptions(num_ctx=4096, num_threads=8)
    loaded = options.load_options(server, {"num_ctx": 1024, "temperature": 0.1}, {"num_ctx": 2048, "use_mmap": False})
    assert loaded == LoadOptions(num_ctx=1024, num_threads=8, use_mmap=False)


@pytest.mark.parametrize(("dialect", "n_predict", "expected"), [
    ("native", -1, {**options.NATIVE_DEFAULTS}),
    ("native", 256, {**options.NATIVE_DEFAULTS, "num_predict": 256}),
    ("openai", -1, {}),
    ("openai", 0, {"num_predict": 0}),
])  # fmt: skip
def test_server_defaults(dialect: options.Dialect, n_predict: int, expected: options.Layer) -> None:
    assert options.server_defaults(dialect, n_predict) == expected


def test_native_defaults_are_the_local_runners() -> None:
    params = options.sampling(options.server_defaults("native"))
    assert (params.temperature, params.top_k, params.top_p, params.repeat_penalty, params.repeat_last_n) == (
        0.8, 40, 0.9, 1.1, 64)
    for name, value in options.NATIVE_DEFAULTS.items():
        assert options.check(TABLE[name], value, name) == value


@pytest.mark.parametrize(("metadata", "expected"), [
    ({"general.sampling.temp": "0.6", "general.sampling.top_k": "20", "general.sampling.top_p": 0.95},
     {"temperature": 0.6, "top_k": 20, "top_p": 0.95}),
    ({"general.sampling.penalty_repeat": 1.05, "general.sampling.penalty_last_n": 128},
     {"repeat_penalty": 1.05, "repeat_last_n": 128}),
    ({"general.sampling.temp": "hot", "general.sampling.top_p": 7.0, "general.name": "x"}, {}),  # untrusted: skipped
    ({}, {}),
])  # fmt: skip
def test_model_defaults_from_gguf_metadata(metadata: dict[str, Any], expected: options.Layer) -> None:
    assert options.model_defaults(metadata) == expected


def test_layer_of_a_fixed_models_sampling() -> None:
    assert options.layer_of(SamplingParams()) == {}
    assert options.layer_of(SamplingParams(temperature=0.1, stop=["x"], max_tokens=5)) == {
        "temperature": 0.1, "stop": ["x"], "num_predict": 5}


def test_the_native_json_schema_lists_every_native_option() -> None:
    schema = options.json_schema()
    assert set(schema["properties"]) == set(options.PARAMETERS) and schema["additionalProperties"] is False
    assert schema["properties"]["top_p"] == {"type": "number", "description": TABLE["top_p"].help,
                                             "exclusiveMinimum": 0, "maximum": 1}


@pytest.mark.parametrize("stored", [{"tfs_z": 0.5}, {"frobnicate": 1}, {"top_p": 7.0}])
def test_a_stored_parameter_lmserve_does_not_take_says_to_create_the_model_again(stored: dict[str, object]) -> None:
    name = next(iter(stored))
    with pytest.raises(InvalidRequest, match=f"Modelfile has PARAMETER {name}.*create the model again") as info:
        options.from_parameters(stored)
    assert info.value.param == name

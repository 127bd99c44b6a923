"""Spec for lmserve.store.modelfile: parse(text) → Modelfile, errors with line numbers, to_text() round trip."""

from __future__ import annotations

import pytest

from lmserve.errors import InvalidRequest
from lmserve.store.modelfile import (
    LOAD_TIME_PARAMETERS,
    PARAMETER_TYPES,
    Modelfile,
    ModelfileError,
    parse,
    parse_parameter,
)

# The seed's deployment-guide example for an LFM2 GGUF, verbatim.
LFM2_MODELFILE = '''FROM /path/to/model.gguf
TEMPLATE """<|startoftext|><|im_start|>system
{{ .System }}<|im_end|>
<|im_start|>user
{{ .Prompt }}<|im_end|>
<|im_start|>assistant
"""
PARAMETER temperature 0.1
PARAMETER top_k 50
PARAMETER repeat_penalty 1.05
PARAMETER stop "<|im_end|>"
PARAMETER stop "<|endoftext|>"
'''

LFM2_TEMPLATE = (
    "<|startoftext|><|im_start|>system\n{{ .System }}<|im_end|>\n<|im_start|>user\n{{ .Prompt }}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_the_seed_lfm2_example() -> None:
    assert parse(LFM2_MODELFILE) == Modelfile(
        from_="/path/to/model.gguf",
        template=LFM2_TEMPLATE,
        parameters={"temperature": 0.1, "top_k": 50, "repeat_penalty": 1.05, "stop": ["<|im_end|>", "<|endoftext|>"]},
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("FROM llama3", Modelfile(from_="llama3")),
        ("from llama3:8b", Modelfile(from_="llama3:8b")),
        ("  From   ./model.gguf  ", Modelfile(from_="./model.gguf")),
        ('FROM "./my models/x.gguf"', Modelfile(from_="./my models/x.gguf")),
        ("FROM hf.co/org/repo:Q4_K_M", Modelfile(from_="hf.co/org/repo:Q4_K_M")),
        ("FROM ./model-dir", Modelfile(from_="./model-dir")),
        (
            "FROM ./lfm2-vl.gguf\nFROM ./mmproj-lfm2-vl-f16.gguf",
            Modelfile(from_="./lfm2-vl.gguf", projector="./mmproj-lfm2-vl-f16.gguf"),
        ),
        ("FROM dir/MMPROJ.GGUF\nFROM llava:7b", Modelfile(from_="llava:7b", projector="dir/MMPROJ.GGUF")),
        (f"FROM /s/blobs/sha256-{'a' * 64}\nFROM /s/blobs/sha256-{'b' * 64}",  # as show --modelfile prints one
         Modelfile(from_=f"/s/blobs/sha256-{'a' * 64}", projector=f"/s/blobs/sha256-{'b' * 64}")),
        ("# a comment\n\n   # indented comment\nFROM x\n", Modelfile(from_="x")),
        ("FROM x\r\nSYSTEM hi\r\n", Modelfile(from_="x", system="hi")),
        ("FROM x\nSYSTEM You are # not a comment", Modelfile(from_="x", system="You are # not a comment")),
        ("FROM x\nSYSTEM one\nSYSTEM two", Modelfile(from_="x", system="two")),
        ('FROM x\nSYSTEM """\nmulti\n  line\n"""', Modelfile(from_="x", system="\nmulti\n  line\n")),
        ('FROM x\nSYSTEM """one line"""   ', Modelfile(from_="x", system="one line")),
        ('FROM x\nSYSTEM ""', Modelfile(from_="x", system="")),
        ('FROM x\nSYSTEM """"""', Modelfile(from_="x", system="")),
        ('FROM x\nSYSTEM "say \\"hi\\"\\n\\tthen\\\\ \\q"', Modelfile(from_="x", system='say "hi"\n\tthen\\ \\q')),
        (
            'FROM x\nTEMPLATE """{{ "quoted" }} and ""two""\n"""',
            Modelfile(from_="x", template='{{ "quoted" }} and ""two""\n'),
        ),
        (
            "FROM x\nMESSAGE user Is the sky blue?\nmessage ASSISTANT yes\nMESSAGE system be brief\nMESSAGE tool {}",
            Modelfile(
                from_="x",
                messages=[("user", "Is the sky blue?"), ("assistant", "yes"), ("system", "be brief"), ("tool", "{}")],
            ),
        ),
        ('FROM x\nMESSAGE user """two\nlines"""', Modelfile(from_="x", messages=[("user", "two\nlines")])),
        (
            "FROM x\nADAPTER ./lora-a.gguf\nADAPTER ./lora-b.gguf",
            Modelfile(from_="x", adapters=["./lora-a.gguf", "./lora-b.gguf"]),
        ),
        ('FROM x\nLICENSE """MIT\n"""\nLICENSE Apache-2.0', Modelfile(from_="x", license=["MIT\n", "Apache-2.0"])),
        ("FROM x\nREQUIRES 0.6.0", Modelfile(from_="x", requires="0.6.0")),
        ("SYSTEM first\nFROM x", Modelfile(from_="x", system="first")),
    ],
)
def test_directives(text: str, expected: Modelfile) -> None:
    assert parse(text) == expected


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("PARAMETER temperature 0.7", {"temperature": 0.7}),
        ("PARAMETER temperature 1", {"temperature": 1.0}),
        ("PARAMETER temperature .5", {"temperature": 0.5}),
        ("PARAMETER top_k 40", {"top_k": 40}),
        ("PARAMETER top_p 0.9", {"top_p": 0.9}),
        ("PARAMETER min_p 0.05", {"min_p": 0.05}),
        ("PARAMETER typical_p 1.0", {"typical_p": 1.0}),
        ("PARAMETER repeat_penalty 1.1", {"repeat_penalty": 1.1}),
        ("PARAMETER repeat_last_n -1", {"repeat_last_n": -1}),
        ("PARAMETER presence_penalty 1.5e-1", {"presence_penalty": 0.15}),
        ("PARAMETER frequency_penalty -0.5", {"frequency_penalty": -0.5}),
        ("PARAMETER seed 42", {"seed": 42}),
        ("PARAMETER stop <|im_end|>", {"stop": ["<|im_end|>"]}),
        ('PARAMETER stop "User:"\nPARAMETER stop "\\n\\n"', {"stop": ["User:", "\n\n"]}),
        ('PARAMETER stop "a \\"quoted\\" stop"', {"stop": ['a "quoted" stop']}),
        ("PARAMETER num_predict -1", {"num_predict": -1}),
        ("PARAMETER mirostat 2", {"mirostat": 2}),
        ("PARAMETER use_mlock true", {"use_mlock": True}),
        ("PARAMETER tfs_z 1", {"tfs_z": 1.0}),
        ("PARAMETER num_ctx 8192", {"num_ctx": 8192}),
        ("PARAMETER num_batch 512", {"num_batch": 512}),
        ("PARAMETER num_gpu 99", {"num_gpu": 99}),
        ("PARAMETER main_gpu 0", {"main_gpu": 0}),
        ("PARAMETER use_mmap false", {"use_mmap": False}),
        ("PARAMETER use_mmap TRUE", {"use_mmap": True}),
        ("PARAMETER num_thread 8", {"num_thread": 8}),
        ("PARAMETER Temperature 0.2", {"temperature": 0.2}),
        ("PARAMETER seed 1\nPARAMETER seed 2", {"seed": 2}),
    ],
)
def test_parameters_are_typed(line: str, expected: dict[str, object]) -> None:
    parameters = parse(f"FROM x\n{line}").parameters
    assert parameters == expected
    for name, value in parameters.items():
        assert type(value) is (list if name == "stop" else PARAMETER_TYPES[name])


def test_every_reference_parameter_is_known() -> None:
    assert set(PARAMETER_TYPES) >= {
        "temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n",
        "presence_penalty", "frequency_penalty", "seed", "stop", "num_predict", "num_keep",
        "num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread",
    }  # fmt: skip
    assert {"num_ctx", "num_batch", "num_gpu", "main_gpu", "use_mmap", "num_thread"} <= LOAD_TIME_PARAMETERS


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("top_k", "+3", 3),
        ("temperature", "2e0", 2.0),
        ("use_mmap", "1", True),
        ("use_mmap", "f", False),
        ("stop", "###", "###"),
    ],
)
def test_parse_parameter(name: str, value: str, expected: object) -> None:
    assert parse_parameter(name, value) == expected


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("mirostatt", "0", "unknown parameter 'mirostatt'"),
        ("numa", "true", "'numa' is not supported: NUMA placement"),
        ("tfs_z", "0.9", "'tfs_z' is not supported"),
        ("top_p", "1.5", "'top_p' must be at most 1"),
        ("temperature", "-1", "'temperature' must be at least 0"),
        ("top_k", "4.5", "parameter 'top_k' needs int"),
        ("top_k", "1_000", "parameter 'top_k' needs int"),
        ("temperature", "hot", "parameter 'temperature' needs float"),
        ("temperature", "nan", "parameter 'temperature' needs float"),
        ("temperature", "inf", "parameter 'temperature' needs float"),
        ("use_mmap", "maybe", "parameter 'use_mmap' needs bool"),
        ("seed", "", "parameter 'seed' needs a value"),
        ("stop", "", "parameter 'stop' needs a value"),
    ],
)
def test_parse_parameter_refuses_naming_the_parameter(name: str, value: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_parameter(name, value)
    assert message in caught.value.message
    assert caught.value.param == name


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("", 1, "FROM is required"),
        ("# only a comment\nSYSTEM hi\n", 1, "FROM is required"),
        ("FROM ./mmproj-f16.gguf", 1, "FROM is required"),
        ("FROM x\n\nFROB y", 3, "unknown directive 'FROB'"),
        ("FROM x\nPARAMETER mirostat_x 2", 2, "unknown parameter 'mirostat_x'"),
        ("FROM x\nPARAMETER penalize_newline true", 2, "'penalize_newline' is not supported"),
        ("FROM x\nPARAMETER top_p 0", 2, "'top_p' must be above 0"),
        ("FROM x\n# c\nPARAMETER top_k fifty", 3, "parameter 'top_k' needs int value, got 'fifty'"),
        ("FROM x\nPARAMETER temperature", 2, "PARAMETER needs a value"),
        ("FROM x\nPARAMETER", 2, "PARAMETER needs a name and a value"),
        ('FROM x\nPARAMETER stop ""', 2, "parameter 'stop' needs a value"),
        ('FROM x\nSYSTEM hi\nTEMPLATE """{{ .Prompt }}\n\n', 3, 'unterminated """'),
        ('FROM x\nSYSTEM "no end', 2, 'unterminated "'),
        ('FROM x\nSYSTEM "a" b', 2, "unexpected text after the closing quote: 'b'"),
        ('FROM x\nTEMPLATE """a\nb""" c', 2, "unexpected text after the closing quote: 'c'"),
        ("FROM x\nMESSAGE robot hello", 2, "MESSAGE role 'robot' is not one of system, user, assistant, tool"),
        ("FROM x\nMESSAGE developer hello", 2, "MESSAGE role 'developer'"),
        ("FROM x\nMESSAGE user", 2, "MESSAGE needs a value"),
        ("FROM x\nMESSAGE", 2, "MESSAGE needs a role and a text"),
        ("FROM x\nSYSTEM", 2, "SYSTEM needs a value"),
        ("FROM", 1, "FROM needs a value"),
        ('FROM ""', 1, "FROM needs a value"),
        ("FROM x\nFROM y", 2, "a second FROM must be a vision projector"),
        ("FROM x\nFROM mmproj-a.gguf\nFROM mmproj-b.gguf", 3, "a second vision projector"),
    ],
)
def test_errors_carry_the_line_number(text: str, line: int, message: str) -> None:
    with pytest.raises(ModelfileError) as caught:
        parse(text)
    assert caught.value.line == line
    assert message in caught.value.message
    assert caught.value.message.startswith(f"Modelfile line {line}: ")
    assert isinstance(caught.value, InvalidRequest)
    assert caught.value.status == 400


ROUND_TRIP_CASES = [
    Modelfile(from_="llama3"),
    Modelfile(from_="/path/with spaces/model.gguf", projector="./mmproj model.gguf"),
    Modelfile(from_='"odd" name '),
    Modelfile(from_="x", template=LFM2_TEMPLATE, system="You are helpful."),
    Modelfile(from_="x", template='{{ if .System }}"{{ .System }}"{{ end }}\n{{ .Prompt | json }}'),
    Modelfile(from_="x", template='ends with a quote"'),
    Modelfile(from_="x", template='has """ triple quotes inside\nand a newline'),
    Modelfile(from_="x", template="windows\r\nline ends"),
    Modelfile(from_="x", template=""),
    Modelfile(from_="x", template="\n  leading and trailing blanks  \n"),
    Modelfile(from_="x", system='  padded, "quoted" and \\backslashed\\  '),
    Modelfile(from_="x", system='"starts with a quote'),
    Modelfile(from_="x", system="tab\there"),
    Modelfile(from_="x", system=""),
    Modelfile(from_="x", parameters={"stop": ["<|im_end|>", "User: ", ' "quoted" ', "\n\n", "back\\slash", "#"]}),
    Modelfile(from_="x", parameters={"temperature": 0.1, "top_k": 50, "repeat_penalty": 1.05, "min_p": 1e-05}),
    Modelfile(from_="x", parameters={"seed": -1, "num_predict": -1, "use_mmap": False, "num_thread": 4}),
    Modelfile(from_="x", parameters={"use_mmap": True, "num_ctx": 32768, "presence_penalty": 1e16}),
    Modelfile(from_="x", messages=[("system", "be brief"), ("user", "Is the sky blue?"), ("assistant", "Yes.")]),
    Modelfile(from_="x", messages=[("user", 'multi\nline "with" quotes'), ("tool", '{"a": 1}'), ("user", "")]),
    Modelfile(from_="x", messages=[("assistant", 'line one\nends with quote"'), ("user", ' """ ')]),
    Modelfile(from_="x", adapters=["./a.gguf", "./b c.gguf"], license=["MIT License\n\nCopyright ...", "x"]),
    Modelfile(from_="x", requires="0.6.0"),
    Modelfile(
        from_="hf.co/LiquidAI/LFM2-VL-1.6B-GGUF:Q4_K_M",
        projector="/models/mmproj-LFM2-VL-1.6B-F16.gguf",
        parameters={"temperature": 0.1, "stop": ["<|im_end|>"], "num_ctx": 4096},
        template=LFM2_TEMPLATE,
        system="You are a vision assistant.\nDescribe images.",
        messages=[("user", "hi"), ("assistant", "hello")],
        adapters=["./lora.gguf"],
        license=["Apache-2.0"],
        requires="0.1.0",
    ),
]


@pytest.mark.parametrize("modelfile", ROUND_TRIP_CASES)
def test_to_text_round_trips(modelfile: Modelfile) -> None:
    text = modelfile.to_text()
    assert parse(text) == modelfile
    assert parse(text).to_text() == text


def test_the_seed_example_round_trips() -> None:
    modelfile = parse(LFM2_MODELFILE)
    assert parse(modelfile.to_text()) == modelfile


def test_to_text_reads_like_a_modelfile() -> None:
    modelfile = Modelfile(
        from_="./lfm2.gguf",
        projector="./mmproj-lfm2.gguf",
        parameters={"temperature": 0.1, "stop": ["<|im_end|>"], "use_mmap": True},
        template="{{ .Prompt }}\n",
        system="Be brief.",
        messages=[("user", "hi")],
    )
    assert modelfile.to_text() == (
        "FROM ./lfm2.gguf\n"
        "FROM ./mmproj-lfm2.gguf\n"
        "PARAMETER temperature 0.1\n"
        'PARAMETER stop "<|im_end|>"\n'
        "PARAMETER use_mmap true\n"
        'TEMPLATE """{{ .Prompt }}\n"""\n'
        "SYSTEM Be brief.\n"
        "MESSAGE user hi\n"
    )

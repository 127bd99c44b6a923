"""vLLM's KV offloading (--kv-offloading-size): lmserve's option reaches vLLM's configuration under the names the
installed vLLM reads (on the CPU build lmserve refuses it before the engine starts: test_vllm_options.py and
test_factory.py; its workers would refuse it later, "only supported on CUDA-alike and XPU GPUs")."""

from __future__ import annotations

import pytest

from lmserve.engine.vllm.args import VllmOptions, engine_args
from tests.hf_repos import smollm2_repo


@pytest.mark.usefixtures("environment")
def test_an_offloading_size_becomes_vllms_cpu_offloading_connector() -> None:
    options = VllmOptions(num_ctx=1024, num_parallel=2, dtype="float32", kv_offloading_size=2.0)
    from vllm import AsyncEngineArgs  # here, not at the top: importing vLLM costs every worker's collection ~5 s

    arguments = AsyncEngineArgs(**engine_args(smollm2_repo(), options, kv_bytes=2**27))
    transfer = arguments.create_engine_config().kv_transfer_config
    assert transfer is not None and transfer.kv_connector == "OffloadingConnector"
    assert transfer.kv_connector_extra_config["cpu_bytes_to_use"] == 2 * 2**30


@pytest.mark.usefixtures("environment")
def test_no_offloading_size_leaves_vllm_without_a_connector() -> None:
    options = VllmOptions(num_ctx=1024, num_parallel=2, dtype="float32")
    from vllm import AsyncEngineArgs

    arguments = AsyncEngineArgs(**engine_args(smollm2_repo(), options, kv_bytes=2**27))
    assert arguments.create_engine_config().kv_transfer_config is None

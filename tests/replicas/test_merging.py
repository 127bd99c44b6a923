"""The deployment-wide routes merged from every replica's answer."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmserve.replicas.calls import Whole
from lmserve.replicas.merging import merge

JSON = ((b"content-type", b"application/json"),)


def whole(replica: str, data: object, status: int = 200) -> Whole:
    return Whole(replica, status, JSON, json.dumps(data).encode())


def test_metrics_carry_every_replicas_series_labelled_by_replica() -> None:
    exposition = ("# HELP lmserve_requests HTTP requests.\n# TYPE lmserve_requests counter\n"
                  'lmserve_requests_total{{route="/v1/models",status="200"}} {n}\n'
                  "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
                  'vllm:num_requests_running{{model_name="m"}} {n}\n')
    answers = [Whole(name, 200, ((b"content-type", b"text/plain"),), exposition.format(n=n).encode())
               for name, n in (("b", 2), ("a", 1))]
    merged = merge("/metrics", answers)
    samples = {(s.name, s.labels["replica"]): s.value for f in text_string_to_metric_families(merged.body.decode())
               for s in f.samples}
    assert samples == {("lmserve_requests_total", "a"): 1, ("lmserve_requests_total", "b"): 2,
                       ("vllm:num_requests_running", "a"): 1, ("vllm:num_requests_running", "b"): 2}
    assert b"# TYPE vllm:num_requests_running gauge" in merged.body


def test_loads_have_one_entry_per_replica_numbered_by_dp_rank() -> None:
    def load(running: int, usage: float) -> dict[str, object]:
        return {"timestamp": "t", "dp_rank_count": 1, "loads": [{"dp_rank": 0, "num_running_reqs": running}],
                "aggregate": {"total_running_reqs": running, "avg_token_usage": usage}}

    merged = merge("/v1/loads", [whole("a", load(1, 0.2)), whole("b", load(3, 0.4))]).json()
    assert merged["dp_rank_count"] == 2 and [entry["dp_rank"] for entry in merged["loads"]] == [0, 1]
    assert [entry["num_running_reqs"] for entry in merged["loads"]] == [1, 3]
    assert merged["aggregate"] == {"total_running_reqs": 4, "avg_token_usage": pytest.approx(0.3)}


def test_ps_lists_each_model_once_with_its_sizes_summed() -> None:
    entry = {"name": "m", "size": 10, "size_vram": 0, "expires_at": "2026-01-01T00:00:00Z"}
    later = {**entry, "expires_at": "2027-01-01T00:00:00Z"}
    merged = merge("/api/ps", [whole("a", {"models": [entry]}), whole("b", {"models": [later]})]).json()
    assert merged == {"models": [{"name": "m", "size": 20, "size_vram": 0, "expires_at": "2027-01-01T00:00:00Z"}]}


def test_models_are_listed_once() -> None:
    listing = {"object": "list", "data": [{"id": "m", "object": "model"}]}
    assert merge("/v1/models", [whole("a", listing), whole("b", listing)]).json() == listing


def test_a_replica_that_refuses_gives_the_deployments_answer() -> None:
    refused = whole("b", {"error": "unauthorized"}, status=401)
    assert merge("/v1/models", [whole("a", {"data": []}), refused]) == refused
    down = whole("a", {"status": "loading"}, status=503)
    assert merge("/health", [down, whole("b", {"status": "ok"})]).status == 503
    assert merge("/health", [whole("a", {"status": "ok"}), whole("b", {"status": "ok"})]).json() == {"status": "ok"}


def test_no_replica_yet_is_a_503() -> None:
    assert merge("/health", []).status == 503

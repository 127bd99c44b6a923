"""The routes that describe the whole deployment, merged from every replica's own answer.

- GET /metrics: every replica's series in one exposition, each with a `replica` label (sum or average them in
  the query: `sum without (replica) (…)`); Ray's own metrics stay on Ray's metrics port.
- GET /v1/loads: one load entry per replica, `dp_rank` numbering the replicas, `dp_rank_count` their count.
- GET /api/ps: each model once; `size` and `size_vram` summed over the replicas that hold it (what the deployment
  holds in memory for it), the latest `expires_at`.
- GET /v1/models: each model once.
- GET /health: 200 when every replica is ready; else the first replica's 503 that says why.

A replica that answers with an error status (a missing API key: 401) gives that answer as the deployment's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from lmserve.replicas.calls import Whole

MERGED_PATHS = ("/metrics", "/v1/loads", "/api/ps", "/v1/models", "/health")


def merge(path: str, answers: Sequence[Whole]) -> Whole:
    """The deployment's answer to GET `path` (one of MERGED_PATHS) from its replicas' answers."""
    ordered = sorted(answers, key=lambda whole: whole.replica)
    failed = next((whole for whole in ordered if whole.status >= 400), None)
    if failed is not None or not ordered:
        return failed if failed is not None else Whole("", 503, _JSON, b'{"status":"loading","reason":"no replica '
                                                                        b'is running yet"}')
    if path == "/metrics":
        return Whole("", 200, ordered[0].headers, merge_metrics(ordered))
    bodies = [whole.json() for whole in ordered]
    merged = {"/v1/loads": merge_loads, "/api/ps": merge_ps, "/v1/models": merge_models,
              "/health": _first}[path](bodies)
    return Whole("", 200, _JSON, json.dumps(merged).encode())


_JSON = ((b"content-type", b"application/json"),)


def _first(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return bodies[0]


def merge_metrics(answers: Sequence[Whole]) -> bytes:
    """Every replica's exposition in one, each sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for whole in answers:
        for family in text_string_to_metric_families(whole.body.decode()):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": whole.replica}, sample.value,
                                  sample.timestamp, sample.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def merge_loads(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """SMG's /v1/loads: one entry per replica (each replica's entries, renumbered); the aggregate's totals summed,
    its averages averaged."""
    loads = [dict(entry) for body in bodies for entry in body.get("loads", [])]
    for rank, entry in enumerate(loads):
        entry["dp_rank"] = rank
    merged = {**bodies[0], "dp_rank_count": len(loads), "loads": loads}
    aggregates = [body["aggregate"] for body in bodies if isinstance(body.get("aggregate"), dict)]
    if aggregates:
        merged["aggregate"] = {key: sum(a.get(key, 0) for a in aggregates) / (len(aggregates) if
                                                                             key.startswith("avg_") else 1)
                               for key in aggregates[0]}
    return merged


def merge_ps(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """/api/ps: each model once, its sizes summed over the replicas holding it."""
    models: dict[str, dict[str, Any]] = {}
    for body in bodies:
        for entry in body.get("models", []):
            held = models.get(entry["name"])
            if held is None:
                models[entry["name"]] = dict(entry)
                continue
            for key in ("size", "size_vram"):
                if isinstance(entry.get(key), int):
                    held[key] = held.get(key, 0) + entry[key]
            held["expires_at"] = max(str(held.get("expires_at", "")), str(entry.get("expires_at", "")))
    return {"models": list(models.values())}


def merge_models(bodies: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """/v1/models: each model once, in the first replica's order."""
    seen: dict[str, dict[str, Any]] = {}
    for body in bodies:
        for entry in body.get("data", []):
            seen.setdefault(entry["id"], entry)
    return {"object": "list", "data": list(seen.values())}

"""The Ray Serve application's options: the builder takes lmserve's options by name, and refuses what it cannot
serve before Ray starts anything."""

from __future__ import annotations

import pytest

from lmserve.config import ConfigError, resolve
from lmserve.replicas.app import application, build


def deployments(app: object) -> dict[str, dict[str, object]]:
    """name → the options each deployment of a built application was given."""
    found: dict[str, dict[str, object]] = {}
    node = app._bound_deployment  # type: ignore[attr-defined]
    while node is not None:
        found[node.name] = node._deployment_config.model_dump() | {"ray_actor_options": node.ray_actor_options}
        node = next((arg._bound_deployment for arg in node.init_args if hasattr(arg, "_bound_deployment")), None)
    return found


def test_build_takes_the_options_by_name() -> None:
    built = deployments(build({"model": "smollm2:135m", "replicas": 3, "parallel": 2, "replica_cpus": 0.5}))
    replica = built["Replica"]
    assert replica["num_replicas"] == 3 and replica["ray_actor_options"]["num_cpus"] == 0.5
    assert built["Ingress"]["num_replicas"] == 1


def test_autoscaling_targets_the_slots_of_a_replica() -> None:
    config = resolve({}, {"LMSERVE_MIN_REPLICAS": "1", "LMSERVE_MAX_REPLICAS": "4", "LMSERVE_PARALLEL": "3"})
    scaling = deployments(application(config))["Replica"]["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 4, 3)


@pytest.mark.parametrize(("args", "message"), [
    ({"modle": "x"}, "modle: not an option of lmserve serve"),
    ({"min_replicas": 3, "max_replicas": 2}, "--min-replicas 3 is more than --max-replicas 2"),
    ({"min_replicas": 1}, "--min-replicas autoscales up to --max-replicas"),
    ({"replicas": 0}, "LMSERVE_REPLICAS"),
])
def test_what_cannot_be_served_is_refused_by_name(args: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(args)

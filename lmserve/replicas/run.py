"""`lmserve serve MODEL --replicas N` (or --min-replicas/--max-replicas): the Ray Serve application on a Ray of
its own started on this machine, or on the cluster at --ray-address, until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path

from lmserve.config import ConfigError, ServerConfig

APP_NAME = "lmserve"


def run(config: ServerConfig) -> int:
    """Serve `config`'s model as Ray Serve replicas on config.host:config.port; the exit status."""
    import ray
    from ray import serve

    from lmserve.parsing import Address
    from lmserve.replicas.app import application

    try:
        app = application(config)
    except ConfigError as exc:
        print(f"lmserve: {exc}", file=sys.stderr)
        return 2
    if config.ray_address is None:  # Ray's workers run at nice 15; the replicas are this server's work, not a side job
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=config.ray_address, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which puts handlers of its own there
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        scaling = f"{config.min_replicas if config.min_replicas is not None else 1} to {config.max_replicas} " \
            "(autoscaled)" if config.max_replicas else str(config.replicas or 1)
        print(f"lmserve listening on http://{Address(config.host).url_host}:{config.port} (Ray Serve)\n"
              f"  model     {config.model}\n"
              f"  replicas  {scaling}, routed by {config.replica_routing}\n"
              f"  ray       {ray.get_runtime_context().gcs_address}\n"
              f"  store     {Path(config.models_dir).expanduser()}", flush=True)
        stop.wait()
    except Exception as exc:  # a replica that cannot start (its model not found…): Ray's error, in one line
        print(f"lmserve: {' '.join(str(exc).split())[:2000]}", file=sys.stderr)
        return 1
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()
    return 0

"""lmserve as a Ray Serve application: N replicas of one model behind one endpoint (`lmserve serve --replicas N`,
`--min-replicas/--max-replicas`, or `serve run lmserve.replicas.app:build model=…`).

Two tiers, because Ray's prefix-aware router reads the prompt from the argument of a handle call:

- the ingress deployment (app.py `Ingress`) takes every HTTP request, reads the prompt text out of its body
  (calls.py `prompt_text`), and calls the replica deployment through a handle with an `HttpCall`;
- each replica (app.py `Replica`) is a whole lmserve server in one Ray actor: the same app every dialect is
  served by, over its own engine instance, run for one call at a time as an ASGI app (calls.py `answer`).

Routing is Ray's: routing.py names the routers (prefix-aware, Ray's power of two choices, round robin) on Ray's
request-router API. Routes that describe the deployment (/metrics, /v1/loads, /api/ps, /v1/models, /health) are
asked of every replica and merged (merging.py). What is stored (models, responses, chat completions,
conversations) lives in the model store's directory, which every replica reads and writes: on one machine that is
the local directory; several machines must mount one shared volume there (`LMSERVE_MODELS`).

Nothing outside this package imports Ray; run.py starts it for `lmserve serve`.
"""

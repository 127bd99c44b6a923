"""Residency: which loaded engine instance serves each model name, and for how long.

Names and instances are separate. An engine instance is one copy of weights in memory, keyed by what changes the
weights or the way they are loaded (`WeightsKey`: the weights file, adapters, projector and every load-time
option). A resident name binds an instance with the name's own prompt settings (template, system, messages,
sampling defaults): models created FROM another that differ only in those share one instance.

- Loading never blocks the other models: no lock is held while weights load; concurrent requests for the same
  weights wait for the one load in progress.
- A name stays resident while requests use it; `keep_alive` (seconds; None = forever; 0 = unload when idle) counts
  from its last use. An instance lives while a resident name binds it or a request still uses it.
- A request whose load-time options differ from the resident instance's gets a fresh instance with its options;
  the old one finishes the requests it is running and is then closed. A context (`num_ctx`) no larger than the
  loaded one is not a difference: the request runs on the loaded instance within its own limit (`serving`). A name
  whose stored settings changed (it was created again) is bound again, on the same instance when its weights and
  load options did not change.
- Before another instance loads beyond `max_loaded`, the least recently used idle instances (and every name bound
  to them) are unloaded. Busy instances are never unloaded for room: the limit is what loading aims for, not a cap.
- With a memory gauge (service/memory_budget.py), what an instance will hold (its plan's estimate: weights, KV
  for its context and slots, buffers) must fit in memory before it loads: the prompt cache is asked to give back
  the shortfall first (`reclaim`), then the least recently used idle instances are unloaded until it fits. A model
  that cannot fit even with every other model unloaded is InsufficientMemory (400, naming both numbers); one that
  would fit once busy models are done is Overloaded (503). `max_loaded` stays a cap on the count beside it.
- An engine that fails (engine/protocol.py `Engine.failure`: its engine process died, its thread failed) has ended
  its requests with an error; it is closed once they are gone, and its names stay bound to it, failed, until a new
  instance replaces it: restarted at once in the background (`heal`), or by the next request for one of them if
  that comes first; other instances are untouched. When restarts keep failing, service/healing.py says when to try
  again; meanwhile requests get EngineStopped (503).
- A load that takes longer than `load_timeout` fails its requests (the engine, should it open later, is closed).
"""

from lmserve.service.residency.models_in_memory import Residency
from lmserve.service.residency.opening import log_load
from lmserve.service.residency.records import (
           LoadedModel,
           LoadPlan,
           ModelHealth,
           Planner,
           Prompter,
           Resident,
           WeightsKey,
)

__all__ = ["LoadPlan", "LoadedModel", "ModelHealth", "Planner", "Prompter", "Residency", "Resident", "WeightsKey",
           "log_load"]

"""The API dialects, each a thin translator over the one service: `openai` (/v1), `native` (the local runner's
/api), `anthropic` (/v1/messages) and `responses` (/v1/responses). Each package has its `routes.py` (a module-level
router), `schemas.py` (the wire's request models) and its own translating, framing and records. Dialects never
import each other; what they share is in `shared/`, and `table.py`'s DIALECTS tells them apart by path."""

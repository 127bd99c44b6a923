"""Cursor pages of the OpenAI list shape (`{object: "list", data, first_id, last_id, has_more}`): the checks of
their `limit` and `order` parameters, and a page of items that carry ids."""

from __future__ import annotations

from typing import Any, Literal

from lmserve.errors import InvalidRequest

MAX_LIST_LIMIT = 100

Order = Literal["asc", "desc"]


def checked_order(limit: int, order: str) -> Order:
    """`limit` (1 to MAX_LIST_LIMIT) and `order` ("asc" or "desc") checked, a 400 naming the one that is off; the
    order."""
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidRequest(f"limit must be between 1 and {MAX_LIST_LIMIT}", param="limit")
    if order == "asc":
        return "asc"
    if order == "desc":
        return "desc"
    raise InvalidRequest("order must be 'asc' or 'desc'", param="order")


def list_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """The OpenAI list shape around `data` (items with an `id`)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def item_page(items: list[dict[str, Any]], *, limit: int, order: str, after: str | None,
              noun: str = "item") -> dict[str, Any]:
    """A page of `items` (kept in ascending order): `limit` of them in `order`, after the item whose id is `after`
    (an id no item has is a 400 naming `noun`)."""
    ordered = items if checked_order(limit, order) == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise InvalidRequest(f"no {noun} has the id '{after[:100]}'", param="after")
        ordered = ordered[ids.index(after) + 1:]
    return list_body(ordered[:limit], len(ordered) > limit)

"""Limits on requests that every dialect shares."""

from __future__ import annotations

MAX_STOPS = 16
"""The most stop sequences a request may give (OpenAI's `stop`, Anthropic's `stop_sequences`)."""

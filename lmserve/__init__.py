"""lmserve: serve open-weight chat models over OpenAI-compatible and native HTTP routes."""

__version__ = "0.1.0"

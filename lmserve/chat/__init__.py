"""Chat formatting: prompt templates, tool-call parsing and media decoding."""

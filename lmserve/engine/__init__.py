"""Inference engine: a continuous-batching loop over a backend (llama.cpp, or a fake for tests)."""

"""A tiny llama GGUF for coding-agent tests: SmolLM2's tokenizer and chat template, a 64k-token trained context, and
weights written by hand so that its replies are known.

Coding agents send prompts of 6k to 30k tokens, past SmolLM2's trained 8,192; a random tiny model holds them but
writes random text until `max_tokens`, so an agent's turn never ends. This model is programmed instead:

- after the `start` token (the last token of the chat template's generation prompt) it writes the tokens of
  `script`, one after another, then ends the turn (SmolLM2's end-of-turn token);
- if the `marker` token (one of the script's, a word no agent prompt has) is already in the context (the agent sent
  back the model's earlier reply, e.g. a tool call with its result), it ends the turn at once;
- after any other token it ends the turn.

How (hidden size 64, one working layer; everything else is zero, so the residual stream carries the embedding):
dimension i < 46 is "this is script token i" (the start token has its own dimension), the output matrix maps
"script token i" to script token i + 1, the last one to end-of-turn, and the constant dimension `_ONE` to
end-of-turn with a smaller weight, so the script wins where it is active. One attention head, asked by the start
token only, looks for the marker (a key only it has, on the head's last rotary pair, which
`rope_freq_base` 1e12 keeps from turning over 64k positions) and, where it finds them, moves the start token's
state to an "end" dimension: the start token then ends the turn.
The script's tokens must be distinct, must not include `start` and must include `marker`: `check_script` says why
when they do not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.tiny_gguf import finish_gguf

CONTEXT_LENGTH = 65536
NUM_EMBD = 64
NUM_HEAD = 4
NUM_HEAD_KV = 2
NUM_FF = 64
NUM_LAYER = 2
HEAD_DIM = NUM_EMBD // NUM_HEAD
MAX_SCRIPT = 46
_START = 46  # the start token's dimension
_ONE = 47  # every token has 1.0 here
_SEEN = 48  # the marker has 1.0 here: what the attention head looks for
_END = 49  # set by the attention head where the start token finds the marker: end the turn
_STATE = 10.0  # a script or start token's own dimension
_GAIN = 10.0  # output weight of the script's next token
_END_GAIN = 5.0  # output weight of end-of-turn on the constant dimension
_KEY = HEAD_DIM - 2  # the head's last rotary pair, which barely turns at rope_freq_base 1e12


def check_script(script: list[int], start: int, marker: int) -> None:
    """ValueError unless `script` can be written by this model after `start`."""
    if not 0 < len(script) <= MAX_SCRIPT:
        raise ValueError(f"a script has 1 to {MAX_SCRIPT} tokens, not {len(script)}")
    if len(set(script)) != len(script):
        raise ValueError(f"a script's tokens must be distinct: {script}")
    if start in script:
        raise ValueError(f"the start token {start} must not be in the script")
    if marker not in script:
        raise ValueError(f"the marker token {marker} must be in the script {script}")


def write_agent_model(path: str | Path, tokenizer_gguf: str | Path, *, start: int, script: list[int],
                      marker: int) -> Path:
    """Write the programmed model to `path`, with the tokenizer and chat template of `tokenizer_gguf`."""
    check_script(script, start, marker)
    reader = gguf.GGUFReader(tokenizer_gguf)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    n_vocab = len(tokens.data)
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].contents())
    path = Path(path)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-agent")
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(NUM_EMBD)
    writer.add_feed_forward_length(NUM_FF)
    writer.add_block_count(NUM_LAYER)
    writer.add_head_count(NUM_HEAD)
    writer.add_head_count_kv(NUM_HEAD_KV)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(1e12)
    writer.add_layer_norm_rms_eps(1e-5)
    _copy_tokenizer(reader, writer)
    finish_gguf(writer, _tensors(n_vocab, start, script, eos, marker))
    return path


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every `tokenizer.*` key of `reader` (vocabulary, merges, special ids, chat template) into `writer`."""
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value: Any = field.contents()
        writer.add_key_value(name, value, kind, sub_type=sub)


def _tensors(n_vocab: int, start: int, script: list[int], eos: int, marker: int) -> list[tuple[str, np.ndarray]]:
    """Tensor names and arrays in numpy order (rows, cols)."""
    embd = np.zeros((n_vocab, NUM_EMBD), dtype=np.float32)
    embd[:, _ONE] = 1.0
    embd[start, _START] = _STATE
    out = np.zeros((n_vocab, NUM_EMBD), dtype=np.float32)
    out[eos, _ONE] = _END_GAIN
    out[script[0], _START] = _GAIN
    for i, token in enumerate(script):
        embd[token, i] = _STATE
        if i + 1 < len(script):
            out[script[i + 1], i] = _GAIN
    embd[marker, _SEEN] = 1.0
    out[eos, _END] = _GAIN
    out[eos, len(script) - 1] = _GAIN
    # head 0 (KV head 0): only the start token asks (its own dimension is the query); script tokens answer (the key
    # and the value read _SEEN); what it finds moves the start token's state to _END
    q = np.zeros((NUM_HEAD * HEAD_DIM, NUM_EMBD), dtype=np.float32)
    k = np.zeros((NUM_HEAD_KV * HEAD_DIM, NUM_EMBD), dtype=np.float32)
    v = np.zeros((NUM_HEAD_KV * HEAD_DIM, NUM_EMBD), dtype=np.float32)
    o = np.zeros((NUM_EMBD, NUM_HEAD * HEAD_DIM), dtype=np.float32)
    q[_KEY, _START] = 4.0
    k[_KEY, _SEEN] = 4.0
    v[0, _SEEN] = 1.0
    o[_START, 0] = -4.0 * _STATE
    o[_END, 0] = 4.0 * _STATE
    zero = {"ffn_gate": (NUM_FF, NUM_EMBD), "ffn_up": (NUM_FF, NUM_EMBD), "ffn_down": (NUM_EMBD, NUM_FF)}
    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", embd)]
    for layer in range(NUM_LAYER):
        working = layer == 0
        tensors += [
            (f"blk.{layer}.attn_norm.weight", np.ones(NUM_EMBD, dtype=np.float32)),
            (f"blk.{layer}.attn_q.weight", q if working else np.zeros_like(q)),
            (f"blk.{layer}.attn_k.weight", k if working else np.zeros_like(k)),
            (f"blk.{layer}.attn_v.weight", v if working else np.zeros_like(v)),
            (f"blk.{layer}.attn_output.weight", o if working else np.zeros_like(o)),
            (f"blk.{layer}.ffn_norm.weight", np.ones(NUM_EMBD, dtype=np.float32)),
            *[(f"blk.{layer}.{name}.weight", np.zeros(shape, dtype=np.float32)) for name, shape in zero.items()],
        ]
    tensors += [("output_norm.weight", np.ones(NUM_EMBD, dtype=np.float32)), ("output.weight", out)]
    return tensors

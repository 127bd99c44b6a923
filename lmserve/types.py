"""Engine-neutral records shared by every layer: requests, sampling, load options, output chunks.

Wire formats (OpenAI, native) are translated into these exactly once at the edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = ("system", "developer", "user", "assistant", "tool")
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


@dataclass(slots=True)
class ToolCall:
    """A function call made by the assistant; `arguments` is the JSON text of the arguments."""

    name: str
    arguments: str
    id: str = ""


IMAGE_PLACEHOLDER = "\ufffc"
"""U+FFFC OBJECT REPLACEMENT CHARACTER: in the `content` of a message with images, where each image goes, in order.
A message with images and no placeholders gets its images before its text."""

AUDIO_PLACEHOLDER = "\ufffb"
"""U+FFFB INTERLINEAR ANNOTATION TERMINATOR: in the `content` of a message with audio clips, where each clip goes,
in order (as IMAGE_PLACEHOLDER for images; clips without placeholders go before the text, after the images)."""


@dataclass(slots=True)
class Message:
    """One chat message. `content` is plain text; images and audio clips travel separately in `images` and `audio`
    (encoded, checked: see IMAGE_PLACEHOLDER and AUDIO_PLACEHOLDER)."""

    role: Role
    content: str = ""
    images: list[bytes] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    thinking: str = ""
    """An assistant turn's thinking, sent back by the client: a template that keeps earlier thinking reads it (as
    `reasoning_content`, or `.Thinking` in a Go template); any other template never sees it."""
    audio: list[bytes] = field(default_factory=list)
    """Audio clips as sent (a checked WAV, FLAC, OGG or MP3 file each: chat/audio.py)."""


@dataclass(frozen=True, slots=True)
class Bitmap:
    """A decoded image: `width` x `height` pixels as packed 8-bit RGB (`rgb` has width * height * 3 bytes)."""

    width: int
    height: int
    rgb: bytes


@dataclass(frozen=True, slots=True)
class Clip:
    """A decoded audio clip: mono 32-bit float samples (little-endian, -1..1) at `rate` samples per second."""

    samples: bytes
    rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / 4 / self.rate if self.rate > 0 else 0.0


Media = Bitmap | Clip
"""What a prompt's media marker stands for: a decoded image or audio clip."""


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter a request runs with: its file (a GGUF LoRA, or a PEFT directory where the engine takes one) and
    the scale its delta is added at (1.0: as trained; 0: off)."""

    path: str
    scale: float = 1.0
    name: str = field(default="", compare=False)
    """What metrics and logs call it (its model's or registered name); not part of what it is."""


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling, resolved by lmserve/options.py (request → Modelfile → model → server → here).

    `temperature == 0` means greedy decoding. `top_k <= 0`, `top_p >= 1`, `min_p <= 0` and `typical_p >= 1`
    disable those filters. `max_tokens is None` means "until the context is full".
    """

    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    mirostat: int = 0
    """0: off; 1 or 2: Mirostat (version 1 or 2) replaces top_k/top_p/min_p/typical_p, steering to `mirostat_tau`."""
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    grammar: str | None = None
    """A GBNF grammar (root rule `root`) the output must match: structured output (see chat/structured/)."""
    closes_at_limit: bool = True
    """With `grammar` and `max_tokens`: a reply about to run out of tokens is closed in time with the shortest text
    the grammar accepts (service/json_budget.py), so structured output and forced tool calls always parse. False:
    the reply is cut where the limit falls."""
    logprobs: int | None = None
    """None: no log-probabilities; 0..20: each generated token's log-probability and this many likeliest
    alternatives (`Chunk.logprobs`; the distribution is described in engine/logprobs.py)."""
    prompt_logprobs: int | None = None
    """None: none; 0..20: each prompt token's log-probability given the tokens before it (the model's raw
    distribution) and this many likeliest alternatives, on the first chunk (`Chunk.prompt_logprobs`; see
    engine/prompt_logprobs.py). The whole prompt is computed again: no cached prefix is reused."""
    draft_max: int | None = None
    """Speculative decoding: at most this many tokens drafted from the context and verified per step (the output
    is the same as without); 0: off; None: the engine's default (`--draft-max`)."""
    priority: int = 0
    """Scheduling, not sampling, carried here to reach the engine with the request: lower runs first (vLLM's
    convention); a waiting request of lower value takes a slot before, and from, one of higher value. Batch lines
    run at `BATCH_PRIORITY`."""
    score_tokens: list[int] = field(default_factory=list)
    """Judging, not sampling: report log P(token | prompt) of each of these ids at the first position, from the
    model's own distribution (a log-softmax of the raw logits, before any sampling transform), in the final chunk's
    `scores` (at most MAX_SCORE_TOKENS of them; service/judging.py asks for one token with them)."""
    context_limit: int | None = None
    """The most tokens the sequence may hold, prompt and reply: the context the request asked for (`num_ctx`), which
    an instance loaded with a larger one serves without a reload (service/residency/ `Residency.serving`); the
    prompt must fit below it and the reply ends there ("length"). None, or the engine's context or more: the
    engine's context."""
    reuse_limit: int | None = None
    """Reuse at most this many prompt tokens computed before (a slot's memory, a copy, a saved state); the rest is
    computed from there, so it rounds the same however the tokens before it happened to be cached (batched kernels
    round differently for different batch shapes). With checkpoints (`Engine.submit`), a reused prefix that reaches
    past the first is cut back to the last checkpoint it reaches: prefill never runs across a checkpoint, so each
    stretch between two is always computed in one piece. None: reuse all that matches."""
    adapters: tuple[Adapter, ...] = ()
    """Not sampling: the LoRA adapters the model runs this request with (a model made with ADAPTER, `--lora`, a
    request's `lora`), applied per request over the base's loaded weights; (): the base alone."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0


MAX_SCORE_TOKENS = 128
"""The most `score_tokens` one request may name (vLLM's limit for `logprob_token_ids`)."""

PRIORITY_RANGE = (-1000, 1000)
"""The values a request's `priority` may take."""
BATCH_PRIORITY = PRIORITY_RANGE[1]
"""The priority of a batch's lines (the Batch API, `lmserve batch`): the lowest, so interactive requests go first."""

VERIFY_MODES = ("off", "warn", "require")
"""How a model's signature is checked as it enters the store (--verify-signatures, a Modelfile's VERIFY)."""
AUTO_CONTEXT = 0
"""`LoadOptions.num_ctx` for "auto" (no -c, variable, Modelfile or request num_ctx): the engine sizes each
sequence's context from the model and the machine when it loads it (engine/context_size.py)."""
AUTO_CONTEXT_FLOOR = 4096
"""Auto never gives less than this (nor more than the model was trained for)."""
AUTO_CONTEXT_CEILING = 262144
"""Auto never gives more than this (the local runner's largest default)."""
AUTO_KV_FRACTION = 0.25
"""Auto's budget: the KV cache of all slots takes at most this fraction of the memory the weights leave."""


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """Options fixed when a model is loaded, that requests and Modelfiles may set per model (the local runner's
    load options); a change means a reload. What only one engine understands is that engine's launch record
    (engine/<name>/options.py), fixed for the server."""

    num_ctx: int = AUTO_CONTEXT
    """Context tokens per sequence; AUTO_CONTEXT: sized by the engine at load. Never more than the model was
    trained for: the engine caps it there (and says so in its log)."""
    num_parallel: int = 4
    num_gpu_layers: int = 0
    num_threads: int | None = None
    num_batch: int = 512
    main_gpu: int = 0
    """The GPU that holds the model when its layers are not split over several."""
    use_mmap: bool | None = None
    """Map the weights file (True), read it (False), or let llama.cpp choose (None)."""
    use_mlock: bool = False
    """Lock the weights in memory so they are never swapped out."""
    adapters: tuple[str, ...] = ()
    """Paths of LoRA adapter GGUFs applied at scale 1.0 (the Modelfile's ADAPTERs; set by the catalog)."""
    projector: str | None = None
    """Path of the vision projector (mmproj) GGUF; None: the model takes no images (set by the catalog)."""


EFFORTS: dict[str, bool | str] = {
    "none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high",
}
"""The dialects' effort names (OpenAI `reasoning_effort` and `reasoning.effort`, Anthropic `output_config.effort`)
as `ChatRequest.think`: "none" is off; lmserve's levels are low, medium and high, so "minimal" reads as "low" and
"xhigh" and "max" as "high"."""


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """What a request's body set of the options lmserve/options.py tables, before precedence: the service puts them
    over the model's Modelfile PARAMETERs, its recommended sampling and the server's defaults."""

    values: dict[str, Any] = field(default_factory=dict)
    """Option name → checked value (an options.py layer), sampling and load-time options alike."""
    defaults: Literal["openai", "native"] = "openai"
    """Whose server defaults lie under them: the native routes' (the local runner's) or SamplingParams' own."""
    lora: tuple[LoraRef, ...] | None = None
    """The LoRA adapters the request picked (llama-server's `lora`); None: the model's own."""


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A request's pick of a LoRA adapter: by id in the server's list (GET /lora-adapters) or by name (a registered
    adapter, or any model made with ADAPTER), at a scale (1.0: as trained)."""

    id: int | None = None
    name: str | None = None
    scale: float = 1.0


@dataclass(frozen=True, slots=True)
class Speech:
    """What a transcription or translation asks of a speech-to-text model (Whisper), whose prompt is its decoder's
    and not a chat: the task, the clip's language (None: the model tells it) and the text before the clip."""

    task: Literal["transcribe", "translate"]
    language: str | None = None
    prompt: str | None = None


@dataclass(slots=True)
class ChatRequest:
    """A chat turn to complete, engine-neutral. `tools` are OpenAI-shaped function definitions; a
    `forced_tool` ("*" for any) means the reply must be a call (tool_choice required or named)."""

    model: str
    messages: list[Message]
    sampling: SamplingParams
    """The settings no option names (grammar, logprobs …); the service sets the options' fields from `options`."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    forced_tool: str | None = None
    parallel_tool_calls: bool = True
    """False: at most one call per reply (later ones are dropped)."""
    add_generation_prompt: bool = True
    think: bool | str | None = None
    """Reasoning: None (the model's default), False (off), True or an effort "low" | "medium" | "high" (on); the
    dialects' effort names map through EFFORTS."""
    reasoning_budget: int | None = None
    """Most thinking tokens before the thinking is closed and the answer follows (None: the server's setting)."""
    options: RequestOptions = field(default_factory=RequestOptions)
    """The options the request set, sampling and load-time (the service resolves their precedence)."""
    keep_alive: float | None = None
    """Seconds to keep the model loaded after this request (None: server default; negative: forever)."""
    speech: Speech | None = None
    """Set by the transcription routes: how a speech-to-text model is prompted (an audio chat model reads the
    messages, which say the same in words)."""


QuestionKind = Literal["predicate", "choice", "score"]


@dataclass(slots=True)
class Question:
    """A typed question about an input (service/judging.py): a `predicate` (answered Yes or No), a `choice` among
    answers or a `score` on ordered levels (lowest first). `answers` are the texts the model may reply with."""

    kind: QuestionKind
    instructions: str
    answers: list[str]
    descriptions: list[str] = field(default_factory=list)
    """What each answer means ("" for none), shown beside it."""
    images: list[bytes] = field(default_factory=list)
    """Encoded images that are part of the instructions."""
    name: str | None = None


@dataclass(slots=True)
class CompletionRequest:
    """A raw prompt to continue, engine-neutral."""

    model: str
    prompt: str
    sampling: SamplingParams
    """The settings no option names (grammar, logprobs …); the service sets the options' fields from `options`."""
    context: list[int] = field(default_factory=list)
    """Tokens of an earlier exchange to continue (the native dialect's `context`)."""
    prompt_tokens: list[int] | None = None
    """The prompt as token ids of the model's own tokenizer, taken as they are (nothing added): OpenAI's token-id
    prompts. Then `prompt` is empty; the engine checks each id against its vocabulary."""
    images: list[bytes] = field(default_factory=list)
    """Encoded images (checked by chat/media.py) shown to a vision model before the prompt text."""
    options: RequestOptions = field(default_factory=RequestOptions)
    """The options the request set, sampling and load-time (the service resolves their precedence)."""
    keep_alive: float | None = None
    infill: Infill | None = None
    """Fill in the middle: the model writes what goes between `infill.prefix` and `infill.suffix`; `prompt` then
    follows the FIM middle token (llama-server's /infill `prompt`), usually empty."""


@dataclass(slots=True)
class Infill:
    """The text around a gap a code model fills (service/fim.py builds its prompt from the FIM tokens)."""

    prefix: str
    suffix: str
    extra: list[tuple[str, str]] = field(default_factory=list)
    """(filename, text) of other files given as context before the prefix (llama-server's `input_extra`)."""


@dataclass(slots=True)
class Usage:
    """Token accounting of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    """Of the completion tokens, those of the thinking (the thinking text tokenized again)."""
    draft_tokens: int = 0
    """Tokens drafted for speculative decoding (SamplingParams.draft_max), verified by the model."""
    draft_accepted_tokens: int = 0
    """Of the drafted tokens, those the model agreed with (each saved a step)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Timings:
    """Durations of one request, in nanoseconds (the native dialect reports them)."""

    load_ns: int = 0
    prompt_eval_ns: int = 0
    eval_ns: int = 0
    total_ns: int = 0

MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask for (OpenAI's and vLLM's limit)."""


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log-probability (natural log, <= 0) and, in `top`, the likeliest tokens at its place
    (each with an empty `top`), likeliest first. `piece` is the token's bytes; `text` is them as text (a token that
    holds part of a UTF-8 character shows U+FFFD)."""

    token: int
    text: str
    piece: bytes
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class Chunk:
    """A piece of generated output. The last chunk of a request has `finish_reason` set and `usage`."""

    text: str = ""
    reasoning: str = ""
    """Thinking text (a reasoning model's, kept apart from the answer in `text`)."""
    finish_reason: FinishReason | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None
    stop_string: str | None = None
    """On the last chunk of a reply that a stop string ended: which one."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """With `SamplingParams.logprobs`: one entry per generated token whose text this chunk carries (in `text`,
    `reasoning` or the markup of `tool_calls`), in order."""
    scores: list[float] = field(default_factory=list)
    """On the last chunk of a request with `SamplingParams.score_tokens`: their log-probabilities, in order."""
    prompt_logprobs: list[TokenLogprob] | None = None
    """On the first chunk of a request with `SamplingParams.prompt_logprobs`: one entry per prompt token after the
    first, in order."""

    @property
    def is_failed(self) -> bool:
        """The last chunk of a generation that failed (the engine erred or aborted it; `error` may say why)."""
        return self.finish_reason in ("error", "abort")

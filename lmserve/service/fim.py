"""Fill-in-the-middle prompts: the text before and after a gap, arranged around the model's FIM tokens.

The order is llama-server's (`/infill`, and `suffix` on completions): BOS (when the vocabulary adds one), any
extra files (repository-level: `<REPO>myproject\\n`, each `<SEP>name\\n` + text, then `<SEP>filename\\n`; without
those tokens each file's text after a snippet marker; with no extra files, none of this), then `<PRE>` prefix
`<SUF>` suffix `<MID>` and the prompt.
The model then writes the middle. A Modelfile TEMPLATE that reads `.Suffix` renders the prompt itself instead
(Ollama's way), so models whose vocabulary has no FIM tokens can still be given an insert form.
"""

from __future__ import annotations

from collections.abc import Callable

from lmserve.chat.gotemplate import GoChatTemplate
from lmserve.engine.protocol import FimTokens
from lmserve.errors import InvalidRequest
from lmserve.service import prompts
from lmserve.service.residency import LoadedModel
from lmserve.types import CompletionRequest, Infill

SNIPPET_MARKER = "\n\n--- snippet ---\n\n"
"""What separates extra files when the vocabulary has no file-separator token (llama-server's marker)."""
REPO_NAME = "myproject"
"""The repository name written after the repository token (llama-server's)."""
FILE_NAME = "filename"
"""The file name written before the prefix in repository-level FIM (llama-server's)."""


def suffix_template(model: LoadedModel) -> GoChatTemplate | None:
    """The model's Modelfile TEMPLATE when it renders a suffix (reads `.Suffix`); else None."""
    template = model.template
    if isinstance(template, GoChatTemplate) and ".Suffix" in template.template.source:
        return template
    return None


def render_with_template(template: GoChatTemplate, infill: Infill, system: str | None) -> str:
    """The prompt text of an insert through a TEMPLATE with `.Prompt` (the prefix) and `.Suffix`, as Ollama does."""
    return template.template.execute({
        "System": system if system is not None else template.system or "", "Prompt": infill.prefix,
        "Suffix": infill.suffix, "Response": "", "Messages": [], "Tools": [], "AddGenerationPrompt": True,
    })  # fmt: skip


def fim_tokens(model: LoadedModel, param: str) -> FimTokens:
    """The model's FIM tokens; a 400 naming why when its vocabulary has none."""
    tokens = model.engine.info.fim
    if tokens is None:
        raise InvalidRequest(
            f"model '{model.name}' cannot fill in the middle: its vocabulary has no fill-in-the-middle tokens "
            "(prefix, suffix and middle); use a code model trained for it", param=param)
    return tokens


def infill_prompt(model: LoadedModel, infill: Infill, prompt: str = "", *, param: str = "suffix") -> list[int]:
    """The prompt tokens that ask `model` for the middle of `infill` (`prompt` follows the middle token)."""
    fim = fim_tokens(model, param)
    engine = model.engine

    def text(value: str) -> list[int]:
        return engine.tokenize(value, add_special=False, parse_special=False) if value else []

    tokens = engine.tokenize("", add_special=True, parse_special=False)  # BOS, when the vocabulary adds one
    if infill.extra:
        tokens += _extra_files(fim, infill.extra, text)
    return [*tokens, fim.prefix, *text(infill.prefix), fim.suffix, *text(infill.suffix), fim.middle, *text(prompt)]


def completion_prompt(model: LoadedModel, request: CompletionRequest) -> list[int]:
    """The prompt tokens of a completion: its `context` then its prompt, or with `infill` the insert form (the
    model's `.Suffix` TEMPLATE, else its FIM tokens)."""
    if request.infill is None:
        given = request.prompt_tokens
        if given is None:
            return list(request.context) + prompts.tokenize(model, request.prompt)
        num_vocab = model.engine.info.num_vocab
        if any(not 0 <= token < num_vocab for token in given):
            raise InvalidRequest(f"prompt token ids must be in [0, {num_vocab}) for this model", param="prompt")
        return list(request.context) + list(given)
    if request.context:
        raise InvalidRequest("suffix cannot be combined with context", param="context")
    template = suffix_template(model)
    if template is not None and not request.infill.extra:
        text = render_with_template(template, request.infill, None) + request.prompt
        return prompts.tokenize(model, text)
    return infill_prompt(model, request.infill, request.prompt)


def _extra_files(fim: FimTokens, extra: list[tuple[str, str]], text: Callable[[str], list[int]]) -> list[int]:
    """Other files as context: the repository-level pattern when the vocabulary has its tokens, else each file's
    text after a snippet marker."""
    tokens: list[int] = []
    if fim.repo is not None and fim.separator is not None:
        tokens += [fim.repo, *text(REPO_NAME + "\n")]
    for filename, body in extra:
        if fim.separator is not None:
            tokens += [fim.separator, *text((filename or "tmp") + "\n")]
        else:
            tokens += text(SNIPPET_MARKER)
        tokens += text(body)
    if fim.separator is not None:
        tokens += [fim.separator, *text(FILE_NAME + "\n")]
    return tokens

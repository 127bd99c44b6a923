"""Hugging Face repositories (config.json + safetensors + tokenizer) for the vLLM engine, made without a download.

- `smollm2_repo()`: the embedded SmolLM2-135M-Instruct GGUF loaded by transformers (`gguf_file=`) and saved as a
  bf16 safetensors repository (~260 MB): a real model that answers "The capital of France is Paris.".
- `tiny_llama_repo()`: a random Llama (hidden 128, 4 heads of 32, 2 KV heads, fp32) with SmolLM2's tokenizer:
  small enough to compare token for token with transformers, and its heads split over tensor-parallel ranks
  (SmolLM2's 9 heads do not split in 2).
- `tiny_lfm2_repo()`: a random LFM2 (hybrid: conv, conv, attention, conv; hidden 64, head_dim 32 — vLLM's CPU
  attention refuses smaller heads, FFN 128) with SmolLM2's tokenizer and LFM2's chat template: plumbing, not wording.
- `tiny_lfm2_attention_repo()`: the same LFM2 with attention in all four layers (no convolution).
- `tiny_lfm2_moe_repo()`: a random LFM2-MoE (transformers' Lfm2MoeForCausalLM: conv, conv, attention, conv; layer 0
  a dense FFN, the others 4 experts of 64 with top-2 sigmoid routing and a random expert bias).
- `tiny_lfm2_vl_repo()`: a random LFM2-VL (that LFM2 plus a 3-layer SigLIP2 encoder, hidden 64, and the projector)
  with SmolLM2's tokenizer and LFM2-VL's image tokens added (`<image>` first, 49152) and its image processor's
  settings: vLLM serves it where torchvision works (its LFM2-VL image processor needs it).

Each LFM2 member is self-consistent: config.json is the built config's own (`block_auto_adjust_ff_dim=False`,
`block_multiple_of=32`, so the FFN really is `intermediate_size` wide, and the keys vLLM reads: `block_dim`,
`conv_dim`…), the one the weights were made with. (Version 2 kept transformers' default rounding, saved a 256-wide
FFN and patched config.json to say 128: transformers and llama.cpp refused it, vLLM used half of each FFN.)

`lfm2_gguf(repo)`: the GGUF form of a member's text model (float32, tensors unchanged; a vision member's projector
with `projector=True`), converted from the repository by llama.cpp's own `convert_hf_to_gguf.py` from the
llama-cpp-python source distribution (`make llama-server` fetches it; `ConverterMissing` says so where it is absent).

All are built once per machine and kept across runs under the user's cache (`~/.cache/lmserve/test-models/
llama-cpp-<version>/<name>-v<N>`: keyed by this generator's VERSION and the llama.cpp the GGUFs are converted by;
LMSERVE_TEST_CACHE moves it). A build holds a lock, so two workers never build the same model (the second waits and
uses the first's); it is written to a temporary sibling and renamed into place with a manifest of its files' sizes,
and a copy whose files no longer match its manifest is built again. Run as a script (`python -m tests.hf_repos`)
to print their paths, building them first.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

from lmserve.store.embedded import embedded_model_path

VERSION = 3
"""Bump when a repository's recipe changes, so cached copies are rebuilt."""

LFM2_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


MANIFEST = ".manifest.json"
"""The sizes of a built model's files, written last: a model is used only while its files match it."""


def cache_root() -> Path:
    """Where generated models are kept across runs: one folder per llama.cpp (llama-cpp-python) version."""
    base = os.environ.get("LMSERVE_TEST_CACHE") or Path.home() / ".cache" / "lmserve" / "test-models"
    return Path(base) / f"llama-cpp-{version('llama_cpp_python')}"


@contextmanager
def build_lock(final: Path) -> Iterator[None]:
    """Held while `final` is checked and built: one builder per model on this machine, the others wait for it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_manifest(folder: Path, files: list[Path]) -> None:
    sizes = {str(path.relative_to(folder)): path.stat().st_size for path in files}
    (folder / MANIFEST).write_text(json.dumps(sizes, indent=1, sort_keys=True) + "\n")


def intact(folder: Path) -> bool:
    """Whether every file the manifest in `folder` lists is there at its size."""
    try:
        sizes = json.loads((folder / MANIFEST).read_text())
        return all((folder / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, AttributeError):
        return False


def smollm2_repo() -> Path:
    """The embedded SmolLM2 as a bf16 safetensors repository."""
    return _cached("smollm2-135m-instruct", _write_smollm2)


def tiny_llama_repo() -> Path:
    """A tiny random fp32 Llama repository (SmolLM2's tokenizer and chat template)."""
    return _cached("tiny-llama", _write_tiny_llama)


def tiny_lfm2_repo() -> Path:
    """A tiny random hybrid LFM2 repository (SmolLM2's tokenizer)."""
    return _cached("tiny-lfm2", _write_tiny_lfm2)


def tiny_lfm2_attention_repo() -> Path:
    """A tiny random LFM2 repository with attention in every layer (SmolLM2's tokenizer)."""
    return _cached("tiny-lfm2-attention", _write_tiny_lfm2_attention)


def tiny_lfm2_moe_repo() -> Path:
    """A tiny random LFM2-MoE repository (experts, top-k routing, expert bias; SmolLM2's tokenizer)."""
    return _cached("tiny-lfm2-moe", _write_tiny_lfm2_moe)


def tiny_lfm2_vl_repo() -> Path:
    """A tiny random LFM2-VL repository (SmolLM2's tokenizer with LFM2-VL's image tokens)."""
    return _cached("tiny-lfm2-vl", _write_tiny_lfm2_vl)


class ConverterMissing(RuntimeError):
    """llama.cpp's `convert_hf_to_gguf.py` is not on this machine."""


def converter_script() -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` in the llama-cpp-python source distribution of the installed version,
    where `make llama-server` unpacks it; ConverterMissing (saying how to get it) where it is absent."""
    import llama_cpp

    cache = Path(os.environ.get("LLAMA_SERVER_CACHE", Path.home() / ".cache" / "lmserve" / "llama-server"))
    source = cache / "src" / f"llama_cpp_python-{llama_cpp.__version__}" / "vendor" / "llama.cpp"
    script = source / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ConverterMissing(
            f"llama.cpp's converter is not at {script}: `make llama-server` downloads the llama-cpp-python "
            f"{llama_cpp.__version__} source distribution and unpacks it there (needs the network once)")
    return script


def lfm2_gguf(repo: Path, *, projector: bool = False) -> Path:
    """The GGUF form of an LFM2 repository (float32), converted by llama.cpp's converter, cached beside it: the text
    model, or with `projector` a vision repository's projector (mmproj)."""
    final = repo.parent / f"{repo.name}{'-mmproj' if projector else ''}.gguf"
    record = final.parent / f"{final.name}.size"
    with build_lock(final):
        if final.is_file() and record.is_file() and record.read_text().strip() == str(final.stat().st_size):
            return final
        script = converter_script()
        work = final.parent / f".{final.name}-{os.getpid()}"
        command = [sys.executable, str(script), str(repo), "--outfile", str(work), "--outtype", "f32"]
        try:
            subprocess.run(command + (["--mmproj"] if projector else []), check=True, capture_output=True, text=True)
            os.replace(work, final)
            record.write_text(f"{final.stat().st_size}\n")
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {repo}:\n{exc.stderr[-2000:]}") from None
        finally:
            work.unlink(missing_ok=True)
    return final


def cached_folder(name: str, write: Callable[[Path], None]) -> Path:
    """The folder `write` fills, built once under the cache (see the module docstring) and checked on every use."""
    final = cache_root() / name
    with build_lock(final):
        if intact(final):
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
        try:
            write(work)
            write_manifest(work, [path for path in work.rglob("*") if path.is_file()])
            shutil.rmtree(final, ignore_errors=True)
            os.replace(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def _cached(name: str, write: Callable[[Path], None]) -> Path:
    return cached_folder(f"{name}-v{VERSION}", write)


def _write_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="bfloat16")
    model.hf_quantizer = None  # the weights are dequantized now; the GGUF quantizer config cannot be saved
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _write_tiny_llama(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    smol = smollm2_repo()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smol / name, out / name)
    vocab = json.loads((smol / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)


LFM2_HYBRID = ("conv", "conv", "full_attention", "conv")


def lfm2_text_config(vocab: int, layer_types: tuple[str, ...]) -> dict[str, object]:
    """The tiny LFM2 text model's config keywords: what transformers builds from and the keys vLLM reads
    (`block_dim`, `conv_dim`…, which Lfm2Config keeps and saves), all describing the same weights."""
    return dict(
        model_type="lfm2", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=2, num_key_value_heads=1, layer_types=list(layer_types), max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
        block_auto_adjust_ff_dim=False, block_multiple_of=32,  # the FFN is intermediate_size wide, not rounded up
        block_dim=64, block_ffn_dim_multiplier=1.0, conv_dim=64, conv_dim_out=64, conv_L_cache=3, conv_bias=False,
        norm_eps=1e-5,
        initializer_range=0.2,  # loud enough that a reply depends on its prompt (the default gives one newline)
    )


def _copy_tokenizer(out: Path) -> int:
    """SmolLM2's tokenizer and LFM2's chat template into `out`; the vocabulary size."""
    smol = smollm2_repo()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, out / name)
    (out / "chat_template.jinja").write_text(LFM2_TEMPLATE)
    return int(json.loads((smol / "config.json").read_text())["vocab_size"])


def _write_lfm2(out: Path, layer_types: tuple[str, ...]) -> None:
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    keywords = lfm2_text_config(_copy_tokenizer(out), layer_types)
    keywords.pop("model_type")
    torch.manual_seed(0)
    Lfm2ForCausalLM(Lfm2Config(**keywords)).to(torch.bfloat16).save_pretrained(out)


def _write_tiny_lfm2(out: Path) -> None:
    _write_lfm2(out, LFM2_HYBRID)


def _write_tiny_lfm2_attention(out: Path) -> None:
    _write_lfm2(out, ("full_attention",) * 4)


def _write_tiny_lfm2_moe(out: Path) -> None:
    import torch
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    config = Lfm2MoeConfig(
        vocab_size=_copy_tokenizer(out), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, layer_types=list(LFM2_HYBRID),
        num_dense_layers=1, num_experts=4, num_experts_per_tok=2, use_expert_bias=True, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True, initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = Lfm2MoeForCausalLM(config)
    with torch.no_grad():  # a zero bias (the initial one) would leave the routing's bias path untested
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("expert_bias"):
                tensor.copy_(torch.randn_like(tensor) * 0.5)
    model.to(torch.bfloat16).save_pretrained(out)


LFM2_VL_SPECIALS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"] + [
    f"<|img_row_{row}_col_{col}|>" for row in range(1, 11) for col in range(1, 11)]
"""LFM2-VL's image tokens, in its order: the placeholder, an image's bounds, the thumbnail and the tile markers."""

LFM2_VL_PREPROCESSOR = {
    "image_processor_type": "Lfm2VlImageProcessor", "processor_class": "Lfm2VlProcessor", "downsample_factor": 2,
    "encoder_patch_size": 16, "tile_size": 512, "min_image_tokens": 64, "max_image_tokens": 256, "min_tiles": 2,
    "max_tiles": 10, "do_image_splitting": True, "use_thumbnail": True, "max_pixels_tolerance": 2.0,
    "do_resize": True, "size": {"height": 512, "width": 512}, "resample": 2, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_pad": True,
}
"""LFM2-VL's image processor settings (its released defaults), written as JSON: making the processor object would
import torchvision."""


def _write_tiny_lfm2_vl(out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, Lfm2VlConfig, Lfm2VlForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(smollm2_repo())
    tokenizer.add_tokens(LFM2_VL_SPECIALS, special_tokens=True)
    tokenizer.save_pretrained(out)
    text = lfm2_text_config(len(tokenizer), LFM2_HYBRID)  # layers louder than the (tied) embeddings
    text["architectures"] = ["Lfm2ForCausalLM"]  # as released; llama.cpp's converter finds the text model by it
    vision = dict(model_type="siglip2_vision_model", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=2, patch_size=16, num_patches=256, vision_use_head=False)
    config = Lfm2VlConfig(text_config=text, vision_config=vision, projector_hidden_size=64, downsample_factor=2,
                          image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    Lfm2VlForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(out)
    # Released LFM2-VL checkpoints (and vLLM) name the encoder's weights one level deeper than transformers saves.
    weights = load_file(out / "model.safetensors")
    save_file({name.replace("model.vision_tower.", "model.vision_tower.vision_model.", 1): tensor
               for name, tensor in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "preprocessor_config.json").write_text(json.dumps(LFM2_VL_PREPROCESSOR, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Lfm2VlProcessor"}, indent=2))
    (out / "chat_template.jinja").write_text(LFM2_TEMPLATE)



RERANKER_WORDS = ["the", "a", "of", "is", "in", "and", "capital", "france", "paris", "berlin", "tokyo", "city",
                  "what", "bananas", "are", "yellow", "weather", "sun", "river", "seine"]
"""Whole words of the tiny BERT reranker's vocabulary (any other lowercase word is spelled from its letters)."""


def tiny_reranker_repo(arch: str = "bert") -> Path:
    """A tiny random cross-encoder repository (one relevance logit per (query, document) pair): `arch` "bert" is
    a BertForSequenceClassification (hidden 64, 2 layers, 2 heads of 32, FFN 128; a WordPiece vocabulary of
    letters, digits and RERANKER_WORDS, so a pair reads `[CLS] query [SEP] document [SEP]` with token types);
    "llama" is a LlamaForSequenceClassification (tiny_llama_repo's shape, SmolLM2's tokenizer), vLLM's form of a
    decoder reranker (the last token's hidden state through the `score` head)."""
    if arch == "bert":
        return _cached("tiny-bert-reranker", _write_tiny_bert_reranker)
    if arch == "llama":
        return _cached("tiny-llama-reranker", _write_tiny_llama_reranker)
    raise ValueError(f"no tiny reranker of architecture {arch!r}")


def _write_tiny_bert_reranker(out: Path) -> None:
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters),
             *".,?!'-:;()\"", *RERANKER_WORDS]
    tokenizer = BertTokenizerFast(vocab={piece: i for i, piece in enumerate(vocab)}, do_lower_case=True,
                                  model_max_length=512)
    tokenizer.save_pretrained(out)
    config = BertConfig(vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0,
                        num_labels=1, initializer_range=0.2)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(out)


def _write_tiny_llama_reranker(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    smol = smollm2_repo()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol / name, out / name)
    vocab = json.loads((smol / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, num_labels=1, initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(out)

if __name__ == "__main__":
    print(smollm2_repo())
    print(tiny_llama_repo())
    print(tiny_lfm2_repo(), lfm2_gguf(tiny_lfm2_repo()))
    print(tiny_lfm2_attention_repo(), lfm2_gguf(tiny_lfm2_attention_repo()))
    print(tiny_lfm2_moe_repo(), lfm2_gguf(tiny_lfm2_moe_repo()))
    print(tiny_lfm2_vl_repo(), lfm2_gguf(tiny_lfm2_vl_repo()), lfm2_gguf(tiny_lfm2_vl_repo(), projector=True))

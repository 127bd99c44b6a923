"""LoRA adapters of the embedded SmolLM2, made without a download (issue 44).

- `smollm2_peft(seed)`: a PEFT adapter directory (adapter_config.json + adapter_model.safetensors), made by `peft` over
  the SmolLM2 repository of tests/hf_repos.py: rank 8 on q_proj, v_proj and o_proj, random A and B
  (`init_lora_weights=False`) so that greedy output differs from the base's while staying words. Each seed another.
- `smollm2_lora_gguf(seed)`: the same adapter as a q8_0 GGUF LoRA, converted by llama.cpp's `convert_lora_to_gguf.py`
  (the llama-cpp-python source distribution that `make llama-server` unpacks; tests/hf_repos.py `ConverterMissing`
  where it is absent). q8_0 because llama.cpp's CPU matrix products of f32, f16 and bf16 adapters round differently
  for different batch shapes (a reply alone and beside others then differs in its last bits, which flips greedy ties
  on this small model); quantized ones, as quantized weights, do not (measured on 0c1e570; bench/README.md).

Built once per machine under the test-model cache (tests/hf_repos.py), each as its own folder with a manifest.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests import hf_repos

PEFT_VERSION = 1
GGUF_VERSION = 2
"""Bump when a recipe changes, so cached adapters are rebuilt."""
RANK = 8


def smollm2_peft(seed: int) -> Path:
    """A PEFT LoRA directory over the embedded SmolLM2 (its base: tests/hf_repos.py `smollm2_repo`)."""
    return hf_repos.cached_folder(f"smollm2-lora-{seed}-v{PEFT_VERSION}", lambda out: _write_peft(out, seed))


def smollm2_lora_gguf(seed: int) -> Path:
    """The adapter `smollm2_peft(seed)` as a GGUF LoRA (q8_0), converted by llama.cpp's converter."""
    folder = hf_repos.cached_folder(f"smollm2-lora-{seed}-gguf-v{GGUF_VERSION}", lambda out: _convert(out, seed))
    return folder / "adapter.gguf"


def _write_peft(out: Path, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(hf_repos.smollm2_repo(), dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["q_proj", "v_proj", "o_proj"],
                        init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out)


def _convert(out: Path, seed: int) -> None:
    script = hf_repos.converter_script().parent / "convert_lora_to_gguf.py"
    command = [sys.executable, str(script), str(smollm2_peft(seed)), "--base", str(hf_repos.smollm2_repo()),
               "--outfile", str(out / "adapter.gguf"), "--outtype", "q8_0"]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"convert_lora_to_gguf.py failed:\n{exc.stderr[-2000:]}") from None

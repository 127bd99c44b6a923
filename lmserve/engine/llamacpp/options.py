"""The llama.cpp engine's launch options: its flags and LMSERVE_* variables, declared as the server's own are
(option_table.py), and its records' defaults. config.py gathers them into the server's options table."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from lmserve.option_table import ConfigError, option


def _default_cache_ram_mib() -> int:
    """A quarter of the machine's memory, at most 8 GiB (llama-server's --cache-ram default), in MiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1024
    return min(8192, total // 4 // 2**20)


DEFAULT_CACHE_RAM_MIB = _default_cache_ram_mib()
KV_CACHE_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
"""The KV cache types llama.cpp takes (`--cache-type-k/-v`): q8_0 is about half of f16's memory, q4_0 about 0.28."""
FLASH_ATTN_MODES = ("on", "off", "auto")
THREAD_POLICIES = ("adaptive", "fixed")
"""`--thread-policy`: adaptive follows the outside load (engine/llamacpp/cpu_load.py); fixed always uses all the
threads."""
DRAFT_P_MIN = 0.0
"""The default `--draft-p-min` (llama-server's too): no floor. The adaptive draft length (engine/slots/drafting.py
`DraftLength`) already backs off from a draft model that guesses wrong; a floor of 0.75 cut a story's drafts from
159 to 43 with SmolLM2 Q4_1 drafting for its F32 self, whose unsure guesses were still right (1.53x plain decoding
without the floor, 0.83x with it)."""
DRAFT_MODEL_MAX = 16
"""The draft cap with --model-draft when --draft-max is not given: drafts start at 4 tokens and double up to it while
they are accepted whole (engine/slots/drafting.py `DraftLength`)."""


@dataclass(frozen=True, slots=True)
class LlamaCppLaunch:
    """What `lmserve serve` is started with for the models llama.cpp serves; each field is one option."""

    n_gpu_layers: int = option(0, "-ngl", "--n-gpu-layers", env="N_GPU_LAYERS", kind="int", minimum=-1, metavar="N",
                               load="num_gpu_layers", help="layers to offload to a GPU (-1: all)")
    batch_size: int = option(512, "-b", "--batch-size", env="BATCH_SIZE", kind="int", minimum=1, metavar="N",
                             load="num_batch", help="most tokens decoded in one step")
    cache_type_k: str = option("f16", "-ctk", "--cache-type-k", env="CACHE_TYPE_K", choices=KV_CACHE_TYPES,
                               metavar="TYPE",
                               help="KV cache type of the keys: f16, or quantized to save memory (q8_0 about half, "
                               "q4_0 about a quarter)")
    cache_type_v: str = option("f16", "-ctv", "--cache-type-v", env="CACHE_TYPE_V", choices=KV_CACHE_TYPES,
                               metavar="TYPE",
                               help="KV cache type of the values (a quantized type needs flash attention)")
    flash_attn: str = option("auto", "-fa", "--flash-attn", env="FLASH_ATTN", choices=FLASH_ATTN_MODES,
                             help="flash attention: on, off, or auto (llama.cpp's choice: on where its backend has "
                             "it). On a CPU off decodes long contexts faster (2x at 1,600 tokens on SmolLM2) and "
                             "prefills 0.8-0.9x as fast, and a reply then depends on the batch it was computed in "
                             "in its last bits (on: the same alone and beside others)")
    kv_unified: bool = option(False, "-kvu", "--kv-unified", env="KV_UNIFIED", kind="bool",
                              help="one KV pool of --ctx-size tokens shared by all --parallel slots, each growing "
                              "up to all of it, instead of --ctx-size tokens reserved per slot; when the pool is "
                              "full, idle slots' prefix caches go first, then the newest sequences pause and are "
                              "recomputed later (their output unchanged)")
    thread_policy: str = option("adaptive", "--thread-policy", env="THREAD_POLICY", choices=THREAD_POLICIES,
                                help="adaptive: compute with the cores other programs leave free (at most "
                                "--threads), so a busy machine does not stall every step; fixed: always --threads")
    draft_max: int | None = option(None, "--draft-max", env="DRAFT_MAX", kind="int", minimum=0, maximum=64,
                                   metavar="N", shown=f"0, off; {DRAFT_MODEL_MAX} with --model-draft",
                                   help="speculative decoding: draft up to N tokens per step from the sequence's own "
                                   "context (prompt lookup) or the draft model, and keep what the model agrees "
                                   "with; the output is unchanged (a request's draft_max overrides it)")
    model_draft: str | None = option(None, "-md", "--model-draft", env="MODEL_DRAFT", metavar="PATH",
                                     help="speculative decoding with a small GGUF of the same vocabulary (e.g. a "
                                     "smaller model of the family) drafting for each served GGUF model")
    draft_p_min: float = option(DRAFT_P_MIN, "--draft-p-min", env="DRAFT_P_MIN", kind="float", minimum=0.0,
                                maximum=1.0, metavar="P", shown="0, no floor",
                                help="the draft model's draft stops before a token it gives less probability than P")
    cache_ram: int = option(DEFAULT_CACHE_RAM_MIB, "-cram", "--cache-ram", env="CACHE_RAM", kind="int", minimum=0,
                            metavar="MiB", shown=f"{DEFAULT_CACHE_RAM_MIB}: a quarter of this machine's memory, at "
                            "most 8192",
                            help="RAM for the prompt cache beyond the slots, all models together: a slot's state "
                            "is saved there before another prompt takes the slot, and a returning prompt restores "
                            "it instead of computing its prefix again; least recently used out first (0: off)")
    cache_disk: int = option(4096, "--cache-disk", env="CACHE_DISK", kind="int", minimum=0, metavar="MiB",
                             help="disk for the prompt cache, under the model store (prompt-cache/): the states "
                             "saved in RAM are also written there, so a conversation returning after a restart or "
                             "a reload skips its prefill; least recently used out first (0: off)")
    slot_prompt_similarity: float = option(0.5, "-sps", "--slot-prompt-similarity", env="SLOT_PROMPT_SIMILARITY",
                                           kind="float", minimum=0.0, maximum=1.0, metavar="F",
                                           help="a prompt takes the free slot sharing its longest prefix only when "
                                           "that prefix is at least F of the slot's cached tokens; otherwise an "
                                           "empty slot, else the least recently used (its state saved first)")
    mmproj: str | None = option(None, "--mmproj", env="MMPROJ", metavar="PATH",
                                help="vision projector GGUF for a model given as a .gguf path")
    image_min_tokens: int = option(0, "--image-min-tokens", env="IMAGE_MIN_TOKENS", kind="int", minimum=0,
                                   metavar="N", shown="the projector's", help="fewest tokens per image or tile")
    image_max_tokens: int = option(0, "--image-max-tokens", env="IMAGE_MAX_TOKENS", kind="int", minimum=0,
                                   metavar="N", shown="the projector's", help="most tokens per image or tile")

    @property
    def draft_limit(self) -> int:
        """The draft cap for requests that do not set their own: --draft-max, else DRAFT_MODEL_MAX with a draft
        model (a draft model means speculative decoding), else 0 (off)."""
        if self.draft_max is not None:
            return self.draft_max
        return DRAFT_MODEL_MAX if self.model_draft else 0

    @staticmethod
    def check(values: Mapping[str, object], sources: Mapping[str, str]) -> None:
        """Refuse combinations no single option's bounds catch (ConfigError naming the source)."""
        low, high = values.get("image_min_tokens"), values.get("image_max_tokens")
        if isinstance(low, int) and isinstance(high, int) and 0 < high < low:
            raise ConfigError(f"image-max-tokens ({high}) is below image-min-tokens ({low})")
        if "draft_p_min" in values and not values.get("model_draft"):
            raise ConfigError(f"{sources['draft_p_min']} applies to a draft model's drafts: give --model-draft too")

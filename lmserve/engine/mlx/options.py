"""The MLX engine's launch options: its flags and LMSERVE_* variables, declared as the server's own are
(option_table.py). config.py gathers them into the server's options table."""

from __future__ import annotations

from dataclasses import dataclass

from lmserve.option_table import option

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "gpu", "cpu")


@dataclass(frozen=True, slots=True)
class MlxLaunch:
    """What `lmserve serve` is started with for the models MLX serves; each field is one option."""

    mlx_dtype: str = option("auto", "--mlx-dtype", env="MLX_DTYPE", choices=DTYPES,
                            shown="auto: the repository's own on a GPU; float32 on a CPU, where MLX computes "
                            "half-precision types by converting them (about 2x slower)",
                            help="the dtype MLX computes in (a quantized repository's packed weights stay as "
                            "they are)")
    mlx_device: str = option("auto", "--mlx-device", env="MLX_DEVICE", choices=DEVICES,
                             help="where MLX computes: auto (Apple's GPU through Metal where there is one, else the "
                             "CPU), gpu or cpu")

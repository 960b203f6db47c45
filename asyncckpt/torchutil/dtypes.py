"""torch dtypes and their safetensors names (the torch side of format.DTYPE_SIZES).

Complex, quantized and sub-byte types are absent on purpose: safetensors has no
portable name for them, so `save()` refuses them up front.
"""

from __future__ import annotations

import torch

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.int64: "I64",
    torch.uint64: "U64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}

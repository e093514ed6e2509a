"""MXFP4 checkpoints (GPT-OSS's Hub experts) dequantized at load: the ``X_blocks`` / ``X_scales`` pairs read as ``X``.

Layout (OCP microscaling, as the Hub's gpt-oss checkpoints store ``mlp.experts.{gate_up,down}_proj``):
``X_blocks`` uint8 ``[E, rows, G, 16]`` holds two 4-bit e2m1 codes a byte (low nibble first) for 32 values a group,
``X_scales`` uint8 ``[E, rows, G]`` a power-of-two exponent a group (bias 127); the dequantized ``X`` is
``[E, G * 32, rows]`` (the bf16 Hub layout, ``x @ X[e]``).
The values are exact in bf16 and fp32; a read dequantizes one expert at a time into bf16.
"""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``[E, rows, G, 16]`` codes and ``[E, rows, G]`` exponents -> ``[E, G * 32, rows]`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"mxfp4: blocks uint8 [..., G, 16] and scales uint8 [..., G] expected, got {blocks.dtype} "
                         f"{tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    out = []
    for b, s in zip(blocks, scales, strict=True):  # one expert at a time bounds the fp32 temporaries
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2).long()  # [rows, G, 32]
        values = torch.ldexp(table[codes], s.int().unsqueeze(-1) - 127)
        out.append(values.flatten(-2).t().to(dtype))
    return torch.stack(out)


class Mxfp4Source:
    """A checkpoint source (``SafetensorsFiles``-like) whose MXFP4 pairs read as their dequantized tensors."""

    def __init__(self, source):
        self.source, self.path = source, getattr(source, "path", None)
        keys = set(source.keys())
        self.packed = {k[: -len("_blocks")] for k in keys if k.endswith("_blocks") and
                       k[: -len("_blocks")] + "_scales" in keys}
        self._keys = (keys - {f"{k}_{p}" for k in self.packed for p in ("blocks", "scales")}) | self.packed

    def keys(self):
        return self._keys

    def read(self, name: str, index: tuple) -> torch.Tensor:
        """``index`` of the dequantized tensor (bf16: exact), one expert at a time: the host holds the packed codes
        and the requested slice, never the whole dequantized stack in fp32."""
        if name not in self.packed:
            return self.source.read(name, index)
        blocks, scales = (self.source.read(f"{name}_{p}", (...,)) for p in ("blocks", "scales"))
        index = (slice(None),) if index in ((...,), ()) else index
        experts, rest = index[0], index[1:]
        return torch.stack([dequantize_mxfp4(b[None], s[None], torch.bfloat16)[0][rest]
                            for b, s in zip(blocks[experts], scales[experts], strict=True)])

    def shape(self, name: str) -> tuple:
        if name not in self.packed:
            return self.source.shape(name)
        e, rows, groups, _ = self.source.shape(f"{name}_blocks")
        return (e, groups * 32, rows)

"""Device rooflines: the dense bf16 matmul peak and memory bandwidth of the GPUs areno is measured on (MFU in bench/,
the speculative-decoding gate's ``auto`` threshold in ``areno.engine.spec_gate``).

The H200's figures are the ceilings measured there (the project guide's BENCH.md): bf16 dense matmul about
790 TFLOP/s (8192^3, random data), device-to-device copy about 4.3 TB/s. The H100 (SXM) has the same GH100 compute
at the same clocks, so the same matmul peak, and 3.35 TB/s of HBM3 where the H200 has 4.8 TB/s of HBM3e: 3.0 TB/s
is that nominal figure times the 0.9 the H200 reaches of its own. A device not listed here (the CPU, other GPUs)
has no roofline: callers fall back to a documented fixed value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Roofline:
    name: str
    flops: float  # dense bf16 matmul FLOP/s
    bytes_per_s: float  # memory bandwidth (bytes read + written per second)

    @property
    def ridge(self) -> float:
        """FLOPs per byte of memory traffic where a kernel turns from memory-bound to compute-bound."""
        return self.flops / self.bytes_per_s


H200 = Roofline("H200", 790e12, 4.3e12)
H100 = Roofline("H100", 790e12, 3.0e12)
KNOWN = (H200, H100)  # matched in this order against the device's name ("NVIDIA H200", "NVIDIA H100 80GB HBM3")


def roofline_of(name: str) -> Roofline | None:
    """The roofline of the device called ``name`` (a CUDA device name), or None when it is not known."""
    return next((r for r in KNOWN if r.name in name.upper()), None)


def device_roofline(device) -> Roofline | None:
    """The roofline of ``device`` (a ``torch.device``): a known CUDA GPU's, else None (the CPU, other GPUs)."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    return roofline_of(torch.cuda.get_device_name(device))

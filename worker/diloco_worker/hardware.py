"""What a learner knows about its accelerator: the peak throughput that model FLOPs utilisation
(MFU) is measured against."""

from __future__ import annotations

import torch

# dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, in TFLOP/s; the first entry
# whose text appears in the device name wins, so the more specific names come first
_BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
)


def peak_tflops_of(name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``name`` (``torch.cuda.get_device_name``), or None."""
    for part, tflops in _BF16_PEAK_TFLOPS:
        if part in name:
            return tflops
    return None


def peak_flops(device: torch.device, configured_tflops: float = 0.0) -> float | None:
    """FLOP/s to compare with: ``configured_tflops`` when given, else the table's value for a known
    CUDA GPU (training there runs under bf16 autocast), else None (no MFU is reported)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    tflops = peak_tflops_of(torch.cuda.get_device_name(device))
    return tflops * 1e12 if tflops is not None else None

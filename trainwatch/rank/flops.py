"""FLOPs per token and peak FLOP/s, for MFU computed the standard way (PaLM appendix B)."""

from __future__ import annotations

# Dense bf16/fp16 tensor-core peak FLOP/s, without sparsity, by a substring of the
# device name torch reports.  More specific names first.
PEAK_FLOPS_BY_DEVICE = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("MI300X", 1307e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
    ("V100", 125e12),
    ("T4", 65e12),
)


def transformer_flops_per_token(n_params: int, n_layers: int, n_heads: int, head_dim: int,
                                seq_len: int) -> float:
    """Training FLOPs per token: 6·N for the weights plus 12·L·H·Q·T for attention."""
    return 6.0 * n_params + 12.0 * n_layers * n_heads * head_dim * seq_len


def peak_flops_for(device_name: str | None) -> float | None:
    """The peak for a known accelerator, else None (MFU is then reported as unknown)."""
    if not device_name:
        return None
    for key, peak in PEAK_FLOPS_BY_DEVICE:
        if key in device_name:
            return peak
    return None

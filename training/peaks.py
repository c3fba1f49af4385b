"""Peak FLOP/s of known accelerators, for MFU (model FLOPs utilisation).

MFU = model FLOP/s ÷ peak FLOP/s, with model FLOP/s = units/s × the model's training FLOPs per unit
(``models.spec.ModelSpec.flops_per_unit``: forward and backward, active parameters for MoE; the
PaLM paper's definition, Chowdhery et al. 2022, appendix B). Used by ``run.tracking`` (the logged
MFU) and ``benchmarks/device_check.py``. No JAX import at module level.
"""

from __future__ import annotations

import os

# Dense (no 2:4 structured sparsity) peak TFLOP/s of one GPU: bfloat16 tensor core, TF32 tensor core,
# FP32 (non-tensor). NVIDIA's datasheets quote the tensor-core figures "with sparsity"; dense is half.
# Matched against device_kind (case-insensitive substring), first match wins: specific names first.
#   H100 SXM / PCIe: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): SXM
#     BF16 1,979*, TF32 989*, FP32 67; PCIe BF16 1,513*, TF32 756*, FP32 51; NVL BF16 1,671*, TF32 835*, FP32 60
#   H200 SXM / NVL: NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): as H100 SXM; NVL as H100 NVL
#   GH200: NVIDIA GH200 Grace Hopper Superchip datasheet: the GPU's figures are H100 SXM's
#   A100 (SXM and PCIe alike): nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf: BF16 312 (624*),
#     TF32 156 (312*), FP32 19.5
#   L4: NVIDIA L4 datasheet: BF16 242*, TF32 120*, FP32 30.3
#   L40S / L40: NVIDIA L40S and L40 datasheets: L40S BF16 362.05 (733*), TF32 183 (366*), FP32 91.6; L40 BF16
#     181.05 (362.1*), TF32 90.5 (181*), FP32 90.5
#   B200 / GB200: NVIDIA HGX B200 and GB200 NVL72 spec pages (per GPU): B200 BF16 4.5 P*, TF32 2.2 P*,
#     FP32 75; GB200 BF16 5 P*, TF32 2.5 P*, FP32 80
#   (* with sparsity.) The A100, H100 SXM/PCIe, L4 and L40/L40S figures were checked against copies of
#   those datasheets' tables (2026-12); the NVL, GH200 and Blackwell rows are the datasheets' as quoted
#   by third parties, not checked against NVIDIA's own pages here.
PEAKS: tuple[tuple[str, str, float, float, float], ...] = (
    # (device_kind substring, name, bf16, tf32, fp32) in TFLOP/s
    ("GH200", "GH200 (H100 SXM compute)", 989.5, 494.5, 67.0),
    ("H200 NVL", "H200 NVL", 835.5, 417.5, 60.0),
    ("H200", "H200 SXM", 989.5, 494.5, 67.0),
    ("H100 NVL", "H100 NVL", 835.5, 417.5, 60.0),
    ("H100 PCIe", "H100 PCIe", 756.5, 378.0, 51.0),
    ("H100", "H100 SXM", 989.5, 494.5, 67.0),
    ("A100", "A100", 312.0, 156.0, 19.5),
    ("L40S", "L40S", 362.05, 183.0, 91.6),
    ("L40", "L40", 181.05, 90.5, 90.5),
    ("L4", "L4", 121.0, 60.0, 30.3),
    ("GB200", "GB200 (per GPU)", 2500.0, 1250.0, 80.0),
    ("B200", "B200", 2250.0, 1100.0, 75.0),
)


def table_peak(kind: str) -> tuple[str, float, float, float] | None:
    """``(name, bf16, tf32, fp32)`` FLOP/s of the first ``PEAKS`` row whose substring ``kind`` holds."""
    for sub, name, bf16, tf32, fp32 in PEAKS:
        if sub.lower() in kind.lower():
            return name, bf16 * 1e12, tf32 * 1e12, fp32 * 1e12
    return None


def float32_matmul_mode() -> tuple[str, str]:
    """Which tensor-core path XLA takes for a float32 matmul on an NVIDIA GPU: ``tf32``, ``fp32`` or
    ``bf16``, and why (``jax_default_matmul_precision``; ``NVIDIA_TF32_OVERRIDE=0`` turns TF32 off)."""
    import jax

    setting = jax.config.jax_default_matmul_precision
    name = "default" if setting is None else str(setting).lower()
    if os.environ.get("NVIDIA_TF32_OVERRIDE") == "0":
        return "fp32", "NVIDIA_TF32_OVERRIDE=0"
    if name in ("highest", "float32") or "f32_f32_f32" in name:
        return "fp32", f"jax_default_matmul_precision={setting!r}"
    if name == "bfloat16" or name.startswith("bf16_bf16"):
        return "bf16", f"jax_default_matmul_precision={setting!r}"
    return "tf32", f"jax_default_matmul_precision={setting!r}: TF32 on Ampere and later"


def device_peak_flops(device_kind: str, compute_dtype: str = "float32") -> tuple[float, str] | None:
    """One device's dense peak FLOP/s for ``compute_dtype`` (``float32`` or ``bfloat16``) and its
    label, from :data:`PEAKS` (``device_kind``: ``jax.Device.device_kind``); None when the device
    is not in the table (every CPU): MFU is then not known."""
    row = table_peak(device_kind)
    if row is None:
        return None
    name, bf16, tf32, fp32 = row
    if compute_dtype == "bfloat16":
        return bf16, f"{name} datasheet BF16 dense"
    mode, why = float32_matmul_mode()
    return {"tf32": tf32, "fp32": fp32, "bf16": bf16}[mode], f"{name} datasheet {mode.upper()} dense; {why}"

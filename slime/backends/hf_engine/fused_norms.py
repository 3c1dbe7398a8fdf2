"""The model's RMSNorm layers as one torch op each (`torch.nn.functional.rms_norm`).

transformers' RMSNorm runs eight element-wise ops per call, a third of a small model's kernel launches on a GPU;
`F.rms_norm` is one fused kernel on CUDA and bit-identical on the CPU. Only classes computing exactly
weight * (x * rsqrt(mean(x^2) + eps)) in float32 are swapped (not Gemma's), and only after the fused op agrees with
the module's forward on the model's device and dtype; otherwise the log says why.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

STANDARD_RMS_NORMS = frozenset({"Qwen3RMSNorm", "Qwen2RMSNorm", "Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "LlamaRMSNorm",
                                "MistralRMSNorm"})


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)


def _candidates(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in STANDARD_RMS_NORMS
            and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 1
            and isinstance(getattr(m, "variance_epsilon", None), float)]


def _agrees(module: torch.nn.Module) -> str | None:
    """None when the fused op matches `module`'s own forward on its device and dtype, else why not."""
    w = module.weight
    g = torch.Generator(device=w.device).manual_seed(0)
    x = (torch.randn(3, 5, w.shape[0], generator=g, device=w.device) * 4).to(w.dtype)
    try:
        with torch.no_grad():
            want = module.forward(x)
            got = _fused_forward(module, x)
    except Exception as e:  # noqa: BLE001 - an op this torch cannot run here: keep the modules
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape {got.dtype}{tuple(got.shape)} vs the module's {want.dtype}{tuple(want.shape)}"
    # one rounding where the module rounds twice: within two units in the last place of the model's dtype
    tol = 2 * torch.finfo(w.dtype).eps if w.dtype != torch.float32 else 1e-5
    err = float(((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-2)).max())
    return None if err <= tol else f"relative difference {err:.3g} > {tol:.3g}"


def fuse_rms_norms(model) -> int:
    """Swap the forward of the model's standard RMSNorm modules for `F.rms_norm` (after checking it agrees);
    returns how many were swapped."""
    mods = _candidates(model)
    if not mods:
        return 0
    why = _agrees(mods[0])
    if why is not None:
        logger.warning("RMSNorm: kept transformers' modules (torch's rms_norm disagrees on %s/%s: %s)",
                       mods[0].weight.device, mods[0].weight.dtype, why)
        return 0
    for m in mods:
        m.forward = types.MethodType(_fused_forward, m)
    return len(mods)

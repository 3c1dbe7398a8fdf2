"""The model's linear layers through oneDNN on the CPU (`torch.ops.mkldnn._linear_pointwise`).

In float32 torch's CPU `F.linear` uses MKL's sgemm, which runs AVX2 code at half the FMA width on AMD cores; oneDNN
dispatches on the CPU's features (~2x on a 135M model's decode step). Same float32 sum in another order; the weight
stays the module's tensor, so in-place weight updates are seen. Swapped only when the model is float32 on the CPU
and the product agrees with `F.linear` on one of its layers; the log says which.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def _onednn_forward(self, x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() or x.dtype != torch.float32:  # the op has no autograd
        return F.linear(x, self.weight, self.bias)
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.bias, "none",
                                           [], "")
    return y.view(*x.shape[:-1], y.shape[-1])


def _disagreement(module: torch.nn.Module) -> str | None:
    x = torch.randn(7, module.weight.shape[1], generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            want, got = F.linear(x, module.weight, module.bias), _onednn_forward(module, x)
    except Exception as e:  # noqa: BLE001 - an op this torch cannot run here: F.linear stays
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))
    return None if err <= 1e-5 else f"relative difference {err:.3g}"


def use_onednn_linears(model) -> int:
    """Swap the forward of the model's float32 CPU nn.Linear layers for oneDNN's; returns how many."""
    mods = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
            and m.weight.dtype == torch.float32]
    if not mods or not torch.backends.mkldnn.is_available():
        return 0
    why = _disagreement(mods[0])
    if why is not None:
        logger.warning("linear layers: F.linear kept (oneDNN's product disagrees: %s)", why)
        return 0
    for m in mods:
        m.forward = types.MethodType(_onednn_forward, m)
    return len(mods)

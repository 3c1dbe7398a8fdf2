"""The stand-ins SGLang's CPU server imports (slime/backends/sglang_utils/cpu_stand_ins/), checked in our env."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.gptj import modeling_gptj
from transformers.models.qwen3 import modeling_qwen3

from slime.backends.sglang_utils.sglang_engine import CPU_STAND_INS

BASE = 10000.0


def _stand_in_rotary():
    spec = importlib.util.spec_from_file_location("stand_in_custom_ops", os.path.join(CPU_STAND_INS, "vllm",
                                                                                      "_custom_ops.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.rotary_embedding


def sglang_cos_sin_cache(rot_dim: int, max_pos: int) -> torch.Tensor:
    """SGLang's RotaryEmbedding._compute_cos_sin_cache (base 10000, no scaling)."""
    inv_freq = 1.0 / (BASE ** (torch.arange(0, rot_dim, 2, dtype=torch.float) / rot_dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(max_pos, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def transformers_rotary(x: torch.Tensor, positions: torch.Tensor, rot_dim: int, neox: bool) -> torch.Tensor:
    """x: [tokens, heads, head_size]; transformers' own rotary (Qwen3's for neox, GPT-J's otherwise) on the first
    rot_dim channels, the rest passed through (as GPT-NeoX / GPT-J do for a partial rotary dim)."""
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    inv_freq = 1.0 / (BASE ** (torch.arange(0, rot_dim, 2, dtype=torch.float) / rot_dim))
    freqs = positions.float()[:, None] * inv_freq  # [tokens, rot/2]
    if neox:
        emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, tokens, rot]
        q = rot.transpose(0, 1)[None]  # [1, heads, tokens, rot]
        out, _ = modeling_qwen3.apply_rotary_pos_emb(q, q, emb.cos(), emb.sin())
        out = out[0].transpose(0, 1)
    else:
        out = modeling_gptj.apply_rotary_pos_emb(rot[None], freqs.sin()[None], freqs.cos()[None])[0]
    return torch.cat((out, rest), dim=-1)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rot_dim", [32, 16], ids=["full", "partial"])
@pytest.mark.parametrize("layout", ["flat", "heads"])
def test_rotary_stand_in_matches_transformers(neox, rot_dim, layout):
    head_size, q_heads, kv_heads, tokens = 32, 4, 2, 11
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, q_heads, head_size, generator=gen)
    k = torch.randn(tokens, kv_heads, head_size, generator=gen)
    positions = torch.tensor([0, 1, 2, 3, 7, 8, 9, 40, 41, 100, 255])
    cache = sglang_cos_sin_cache(rot_dim, 256)
    q_in, k_in = (q.reshape(tokens, -1).clone(), k.reshape(tokens, -1).clone()) if layout == "flat" else (q.clone(), k.clone())
    _stand_in_rotary()(positions, q_in, k_in, head_size, cache, neox)  # in place, as SGLang calls it
    torch.testing.assert_close(q_in.view(tokens, q_heads, head_size), transformers_rotary(q, positions, rot_dim, neox),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(k_in.view(tokens, kv_heads, head_size), transformers_rotary(k, positions, rot_dim, neox),
                               rtol=0, atol=1e-5)
    assert not torch.equal(q_in.view(tokens, q_heads, head_size), q)  # it did rotate (position 0 alone would not)


def test_rotary_stand_in_keeps_dtype_and_skips_a_missing_key():
    q = torch.randn(3, 64, dtype=torch.bfloat16)
    before = q.clone()
    _stand_in_rotary()(torch.tensor([0, 1, 2]), q, None, 32, sglang_cos_sin_cache(32, 8).bfloat16(), True)
    assert q.dtype == torch.bfloat16 and torch.equal(q[0], before[0]) and not torch.equal(q[1:], before[1:])


def test_torchvision_stand_in_imports_as_sglang_and_transformers_do_and_refuses_use():
    """What SGLang 0.5.23 and transformers 5.19 import at module level, in a fresh interpreter with the stand-ins."""
    code = (
        "import torchvision.transforms as T\n"
        "from torchvision.transforms.functional import InterpolationMode\n"
        "from torchvision.transforms import InterpolationMode as IM, functional as TF\n"
        "from torchvision.io import ImageReadMode, decode_image\n"
        "from torchvision.transforms.functional import pil_to_tensor\n"
        "from torchvision.transforms.v2 import functional as tvF\n"
        "import torchvision\n"
        "assert torchvision.__file__.startswith(sys.argv[1]), torchvision.__file__\n"
        "assert IM is InterpolationMode and InterpolationMode.BICUBIC.value == 'bicubic'\n"
        "try:\n"
        "    T.Compose([])\n"
        "except RuntimeError as e:\n"
        "    assert 'stand-in' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('a stand-in transform ran')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=CPU_STAND_INS)
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code, CPU_STAND_INS], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

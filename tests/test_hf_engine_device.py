"""The embedded engine's device placement, checked without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from slime.backends.hf_engine.batch import PagedBatch
from slime.backends.hf_engine.device import DeviceError, resolve_device, resolve_dtype
from slime.backends.hf_engine.sampling import SamplingParams, prepare_sampling, sample_tokens
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

SPEC = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=128, max_position_embeddings=1024)
# copies are how data is meant to reach the device (one per step); everything else must stay on it
TRANSFERS = {"aten::_to_copy", "aten::copy_", "aten::lift_fresh"}


class DeviceAudit(TorchDispatchMode):
    """Records ops that take a host tensor (of one element or more) beside a device tensor."""

    def __init__(self):
        super().__init__()
        self.mixed: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors if t.dim() > 0}
        if "meta" in devices and "cpu" in devices and func._schema.name not in TRANSFERS:
            self.mixed.append(f"{func._schema.name}: {[(t.device.type, tuple(t.shape)) for t in tensors]}")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def meta_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("device_model")
    return build_tiny_qwen3(str(d), build_tokenizer(list("abcdefghij")), SPEC, seed=0).to("meta").eval()


def test_a_step_and_its_sampling_stay_on_the_models_device(meta_model):
    """Decode rows, a fresh prompt, a prefixed chunk, then every sampling restriction: all on the device, no reads."""
    batch = PagedBatch(meta_model, block_size=4, max_tokens=4096, max_rows=8, min_bucket_saving=8)
    assert batch.device.type == "meta" and batch.prefill_attention == "masked"  # off the CPU: one masked SDPA
    rows = [batch.add_row() for _ in range(4)]
    vocab = meta_model.config.vocab_size
    for row, n in zip(rows, (40, 3, 17, 9)):  # prefill them (the 40-token one in chunks of 16)
        while batch.cached(row) < n:
            take = min(16, n - batch.cached(row))
            batch.forward([(row, [5] * take, batch.cached(row) + take == n)])
    gen = torch.Generator()
    gen.manual_seed(3)
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logit_bias={4: 2.0}),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, sampling_seed=7), SamplingParams()]
    new, other = batch.add_row(), batch.add_row()
    # 4 decode rows, chunks of two fresh prompts of different lengths (one bucket, padded to the longer)
    segments = [(r, [6], True) for r in rows] + [(new, [5] * 12, False), (other, [5] * 7, False)]
    audit = DeviceAudit()
    with audit:
        sb = prepare_sampling(params, [None, None, gen, None], torch.Generator(), vocab, batch.device)
        logits = batch.forward(segments)
        tokens, logprobs = sample_tokens(logits, sb)
    assert audit.ops > 100 and audit.mixed == [], audit.mixed[:5]
    assert len([bk for bk in batch.last_plan.buckets if bk.q == 1]) >= 2  # rows of different lengths, split
    assert [bk.pad is not None for bk in batch.last_plan.buckets if bk.q > 1] == [True]
    assert logits.device.type == "meta" and tuple(logits.shape) == (4, vocab)
    assert tokens.device.type == "meta" and tuple(tokens.shape) == (4,) and tuple(logprobs.shape) == (4,)
    # a chunk with a prefix after the new row's first chunk: the masked path reads keys it wrote this step
    audit = DeviceAudit()
    with audit:
        logits = batch.forward([(r, [6], True) for r in rows] + [(new, [5] * 7, True)])
    assert audit.mixed == [], audit.mixed[:5]
    assert any(bk.q > 1 and bk.p0 > 0 for bk in batch.last_plan.buckets)
    assert tuple(logits.shape) == (5, vocab)
    with pytest.raises(Exception, match="meta"):  # the one read-back a step makes (to_host) is a real read
        tokens.tolist()


def test_device_and_dtype_resolution():
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(DeviceError, match="--device cuda: no CUDA device is visible"):
            resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"  # the CPU's behaviour is unchanged
    assert resolve_dtype("auto", torch.device("cuda")) == "auto"  # the checkpoint's own dtype there
    assert resolve_dtype("torch.float16", torch.device("cpu")) == "float16"
    for bad, msg in (("mps", "runs on cpu or cuda"), ("nonsense!", "not a device")):
        with pytest.raises(DeviceError, match=msg):
            resolve_device(bad)
    with pytest.raises(DeviceError, match="--dtype: unknown dtype"):
        resolve_dtype("float33", torch.device("cpu"))
    with pytest.raises(DeviceError, match="not a floating-point"):
        resolve_dtype("int8", torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_refuses_cuda_without_a_gpu_naming_the_flag(tmp_path):
    build_tiny_qwen3(str(tmp_path), build_tokenizer(list("abc")), SPEC, seed=0)
    out = subprocess.run([sys.executable, "-m", "slime.backends.hf_engine", "--model-path", str(tmp_path),
                          "--device", "cuda", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--device cuda: no CUDA device is visible" in out.stderr, out.stderr[-2000:]


def test_launcher_passes_sglangs_device_and_dtype_flags_to_the_embedded_engine(tmp_path):
    from slime.arguments import parse_args
    from slime.backends.sglang_utils.sglang_engine import build_embedded_engine_command

    (tmp_path / "model").mkdir()
    (tmp_path / "p.jsonl").touch()
    args = parse_args(["--hf-checkpoint", str(tmp_path / "model"), "--prompt-data", str(tmp_path / "p.jsonl"),
                       "--rm-type", "math", "--num-rollout", "1", "--rollout-batch-size", "2",
                       "--sglang-device", "cuda", "--sglang-dtype", "bfloat16"])
    cmd = build_embedded_engine_command(args, engine_rank=0, port=40000)
    assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--dtype") + 1] == "bfloat16"

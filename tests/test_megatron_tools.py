"""tools/convert_hf_to_torch_dist.py and tools/convert_torch_dist_to_hf.py with slime's command lines."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_helpers import megatron_args
from test_fsdp_helpers import make_groups, model_log_probs

from slime.tasks import subtract_chain as task
from slime.utils.tiny_model import TinyQwen3Spec, build_tiny_qwen3, build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(600)
torch.set_num_threads(1)


def _load_tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def model_args() -> list[str]:
    out = subprocess.run(["bash", "-c", f'source "{REPO}/scripts/models/tiny-qwen3.sh"; printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
                         capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("quickstart_shape")
    build_tiny_qwen3(str(d), build_tokenizer(task.VOCAB), TinyQwen3Spec(), seed=3)  # the quick start's shape
    return str(d)


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """The CLI round trip, run once: HF -> torch_dist -> HF."""
    root = tmp_path_factory.mktemp("convert")
    env = {**os.environ, "PYTHONPATH": REPO}
    one = subprocess.run([sys.executable, "tools/convert_hf_to_torch_dist.py", *model_args(), "--hf-checkpoint", hf_dir,
                          "--save", str(root / "torch_dist")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run([sys.executable, "tools/convert_torch_dist_to_hf.py", "--input-dir",
                          str(root / "torch_dist" / "iter_0000000"), "--output-dir", str(root / "hf"),
                          "--origin-hf-dir", hf_dir], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    return root


@pytest.mark.slow  # two CLI processes (megatron import + dist-checkpoint writer each)
def test_round_trip_is_exact(converted, hf_dir):
    assert (converted / "torch_dist" / "latest_checkpointed_iteration.txt").read_text() == "0"
    before = load_file(os.path.join(hf_dir, "model.safetensors"))
    after = load_file(str(converted / "hf" / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k


@pytest.mark.slow
def test_round_trip_loads_in_transformers_and_in_our_engine(converted, hf_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime.backends.hf_engine.local_server import EngineServer

    out = str(converted / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any(torch.isnan(p).any() for p in model.parameters())  # every weight came back as a number
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("47-5=", add_special_tokens=False)) == "47-5="
    srv = EngineServer(out, ["--seed", "0"], log_path=str(converted / "engine.log")).wait_healthy()
    try:
        r = srv.post("/generate", {"input_ids": [1, 5, 6, 7], "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        pairs = r.json()["meta_info"]["output_token_logprobs"]
    finally:
        srv.stop()
    from slime.utils.types import Sample

    s = Sample(index=0, group_index=0, tokens=[1, 5, 6, 7])
    s.append_response([p[1] for p in pairs], [p[0] for p in pairs], 0)
    original = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert torch.allclose(model_log_probs(original, s), torch.tensor([p[0] for p in pairs]), atol=1e-4)


def test_mismatched_model_args_fail_before_converting(hf_dir, tmp_path):
    args = [a if a != "128" else "256" for a in model_args()]  # --hidden-size 256
    out = subprocess.run([sys.executable, "tools/convert_hf_to_torch_dist.py", *args, "--hf-checkpoint", hf_dir,
                          "--save", str(tmp_path / "x")], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "--hidden-size 256 but" in out.stderr
    assert not (tmp_path / "x").exists()


def test_torch_dist_is_a_ref_load(hf_dir, tmp_path):
    """As in slime: --ref-load TORCH_DIST is the reference model and the actor's starting point."""
    from transformers import AutoModelForCausalLM

    from slime.backends.megatron_utils.actor import MegatronTrainer
    from slime.arguments import megatron_flags
    from slime.backends.megatron_utils.convert import hf_to_torch_dist
    from slime.backends.training_utils.data import flatten_groups

    other = tmp_path / "other"
    build_tiny_qwen3(str(other), build_tokenizer(task.VOCAB), TinyQwen3Spec(), seed=4)
    hf_to_torch_dist(megatron_flags(model_args()), str(other), str(tmp_path / "torch_dist"))
    t = MegatronTrainer(megatron_args(hf_dir, "--ref-load", str(tmp_path / "torch_dist"), "--use-kl-loss",
                                      "--kl-loss-coef", "0.1"))
    t.init()
    try:
        want = AutoModelForCausalLM.from_pretrained(str(other), dtype=torch.float32)
        not_this = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        groups = make_groups(seed=5)
        samples = [s for g in groups for s in g]
        items = [it for g in flatten_groups(groups)[0] for it in g]
        for built in (t.actor, t.ref):
            for s, lp in zip(samples, t._log_probs(built, items)):
                assert torch.allclose(lp, model_log_probs(want, s), atol=1e-5)
                assert not torch.allclose(lp, model_log_probs(not_this, s), atol=1e-3)
    finally:
        t.shutdown()


def test_bf16_storage_and_training_checkpoint_export(hf_dir, tmp_path):
    """--bf16 stores bf16 and exports it back exactly; a train.py checkpoint converts the same way."""
    from slime.backends.megatron_utils.actor import MegatronTrainer
    from slime.arguments import megatron_flags
    from slime.backends.megatron_utils.convert import hf_to_torch_dist, torch_dist_to_hf

    hf_to_torch_dist(megatron_flags([*model_args(), "--bf16"]), hf_dir, str(tmp_path / "td_bf16"))
    torch_dist_to_hf(megatron_flags(), str(tmp_path / "td_bf16"), str(tmp_path / "hf_bf16"), hf_dir)
    before = load_file(os.path.join(hf_dir, "model.safetensors"))
    after = load_file(str(tmp_path / "hf_bf16" / "model.safetensors"))
    for k in before:
        assert after[k].dtype == torch.float32 and torch.equal(after[k], before[k].bfloat16().float()), k

    t = MegatronTrainer(megatron_args(hf_dir, lr=1e-2))
    t.init()
    t.train(0, make_groups(seed=6), 0)
    iter_dir = tmp_path / "save" / "iter_0000000"
    (iter_dir / "trainer").mkdir(parents=True)
    t.save(str(iter_dir / "trainer"))
    t.export_hf(str(tmp_path / "exported"))
    t.shutdown()
    torch_dist_to_hf(megatron_flags(), str(iter_dir), str(tmp_path / "from_ckpt"), hf_dir)
    export_hf = _load_tool("export_hf")
    export_hf.export(str(tmp_path / "save"), str(tmp_path / "export_tool"), iteration=0)
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    for other in ("from_ckpt", "export_tool"):
        converted = load_file(str(tmp_path / other / "model.safetensors"))
        assert sorted(converted) == sorted(exported) and all(torch.equal(exported[k], converted[k]) for k in exported)
    assert not torch.equal(exported["model.norm.weight"], before["model.norm.weight"])  # trained weights

"""The GPU launch scripts pass flags that parse and validate (python is shimmed to parse_args only)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_qwen3_4b_dapo_partial_script_flags_validate(tmp_path):
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text(
        "#!/usr/bin/env bash\nshift\n"
        f"exec {sys.executable} -c \"import sys; from slime.arguments import parse_args; "
        "a = parse_args(sys.argv[1:]); print(a.num_engines, a.over_sampling_batch_size, a.partial_rollout, "
        "a.rollout_backend, a.sglang_server_concurrency, sorted(a.sglang_extra_args))\" \"$@\"\n"
    )
    (shim / "python").chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}", "MODEL_DIR": str(model), "DATA": str(data),
           "EVAL": str(data), "SAVE": str(tmp_path / "ckpt"), "PYTHONPATH": REPO}
    out = subprocess.run(["bash", os.path.join(REPO, "scripts/partial_rollout/qwen/grpo/run-qwen3-4B-dapo-partial.sh")],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["4", "64", "True", "sglang", "256", "['mem-fraction-static']"]

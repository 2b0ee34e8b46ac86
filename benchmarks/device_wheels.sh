#!/usr/bin/env bash
# The wheels run_h200.sh installs on the lent GPU machine, which reaches no package index. They are built here,
# at the versions this machine's venv runs (the device image has older transformers, grpcio and protobuf):
#   .whl       the runtime packages, and accelerate and psutil for transformers' device_map (its torch is the image's)
#   .whl-test  what the test suite imports that .whl lacks
# Both stay out of git (.git/info/exclude) and travel as `carry` (the tree and both fit under the 64 MiB limit).
# Usage: bash benchmarks/device_wheels.sh   (PYTHON: the venv's python, default kubemoe's cached one)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$HOME/.cache/kubemoe/venv/bin/python}
pinned() { for p in "$@"; do echo "$p==$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")"; done; }
get() {
  "$PY" -m pip download -q --disable-pip-version-check --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 "$@"
}
rm -rf .whl .whl-test
get -d .whl $(pinned transformers tokenizers safetensors huggingface_hub grpcio grpcio-health-checking grpcio-reflection protobuf)
get -d .whl --no-deps accelerate==1.15.0 psutil
rm -f .whl/numpy-*  # the image's numpy is the one its torch was built with
get -d .whl-test pytest pytest-asyncio pytest-timeout hypothesis kubernetes kopf prometheus-client aiohttp click pyyaml tqdm openai
for wheel in .whl-test/*.whl; do [ ! -f ".whl/${wheel#.whl-test/}" ] || rm "$wheel"; done  # install finds them in .whl
for folder in .whl .whl-test; do grep -qx "/$folder/" .git/info/exclude 2>/dev/null || echo "/$folder/" >> .git/info/exclude; done
du -sh .whl .whl-test

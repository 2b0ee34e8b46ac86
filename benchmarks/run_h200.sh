#!/usr/bin/env bash
# Run kubemoe's GPU benchmarks and tests on the lent H200 (the device tool): carries .whl
# (transformers, grpcio, protobuf at kubemoe's versions; the machine's image has older ones) and,
# for the tests, .whl-test (pytest and the test suite's imports; `pip download --python-version 3.12
# --only-binary=:all: -d .whl-test pytest pytest-asyncio pytest-timeout hypothesis kubernetes kopf
# prometheus-client aiohttp click pyyaml tqdm openai`). Results go into $OUT.
# Usage there: KUBEMOE_COMMIT=<sha> bash benchmarks/run_h200.sh expert_fn|frontend|gpu-tests [ARGS]
# (the tree arrives without .git, so the commit it was taken from is passed in; ARGS go to the benchmark).
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers, grpc; print("torch", torch.__version__, "transformers", transformers.__version__, "grpc", grpc.__version__)'
case "${1:-all}" in
  expert_fn) python3 benchmarks/expert_fn_overhead.py --device cuda --out "$OUT" "${@:2}" ;;
  gpu-tests)
    python3 -m pip install -q --no-index --find-links .whl-test --no-compile --upgrade --target /tmp/site-test \
      pytest pytest-asyncio pytest-timeout hypothesis kubernetes kopf prometheus-client aiohttp click pyyaml tqdm openai
    PYTHONPATH="/tmp/site:/tmp/site-test:$PWD" python3 -m pytest -q -p no:cacheprovider -m gpu tests ;;
  frontend) python3 benchmarks/frontend_decode.py --device cuda --preset mixtral-4l --layers 2 --steps 30 --warmup 5 --out "$OUT" "${@:2}" ;;
  *) echo "usage: $0 expert_fn|frontend|gpu-tests" >&2; exit 2 ;;
esac

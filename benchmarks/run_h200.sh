#!/usr/bin/env bash
# Run kubemoe's GPU benchmarks and tests on the lent H200 (the device tool), carrying .whl (the runtime wheels at
# kubemoe's versions: the machine's image has older ones) and, for the tests, .whl-test; both are built here by
# `bash benchmarks/device_wheels.sh`. Results go into $OUT.
# Usage there: KUBEMOE_COMMIT=<sha> bash benchmarks/run_h200.sh expert_fn|frontend|frontend-full|frontend-mixtral|chunked-prefill|predictor|llapor|offload|moeless-live|replan-probe|replan-ab|dispatch-calls|call-cpu|offload-ab|grouped-slots|decode-step|engine-step|prefill-step|disagg-step|step-flags|gpu-tests|probe|profile|goal-ab [ARGS]
# (gpu-tests [PATHS]: the GPU tests under PATHS, default all of tests/)
# (the tree arrives without .git, so the commit it was taken from is passed in; ARGS go to the benchmark).
set -euo pipefail
# Required: git on that machine may answer a stale HEAD (it did: results of code at 61a5e03 say 8a1f177)
: "${KUBEMOE_COMMIT:?set KUBEMOE_COMMIT to the sha the tree was taken from, read where it was committed}"
# Once per machine, under a lock: on a two-GPU host two of these run side by side (CUDA_VISIBLE_DEVICES=0 and 1)
install() (  # install TARGET PIP-ARGS...: skipped when an earlier run finished the same install
  exec 9>"$1.lock"; flock 9; [ -f "$1/.installed" ] || { python3 -m pip install -q --no-compile --upgrade --target "$@"; touch "$1/.installed"; }
)
install /tmp/site --no-index --no-deps --no-cache-dir .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${KUBEMOE_MPS:-0}" = 1 ]; then  # processes share the GPU through MPS (concurrent kernels), not time-slices
  if command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && echo "MPS control daemon started"
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
  else
    echo "KUBEMOE_MPS=1 but no nvidia-cuda-mps-control on this machine: processes time-slice the GPU" >&2
  fi
fi
python3 -c 'import torch, transformers, grpc; print("torch", torch.__version__, "transformers", transformers.__version__, "grpc", grpc.__version__)'
replan_probe() {  # 8 Mixtral-sized expert-function processes on this GPU, 2 experts a layer moved a re-plan
  python3 benchmarks/experiments/replan_probe.py --device cuda --hidden 4096 --intermediate 14336 --processes 8 \
    --experts 16 --moves 2 --tokens 256 "$@"
}
case "${1:-all}" in
  expert_fn) python3 benchmarks/expert_fn_overhead.py --device cuda --out "$OUT" "${@:2}" ;;
  gpu-tests)
    install /tmp/site-test --no-index --find-links .whl-test --find-links .whl \
      pytest pytest-asyncio pytest-timeout hypothesis kubernetes kopf prometheus-client aiohttp click pyyaml tqdm openai
    targets=("${@:2}"); [ ${#targets[@]} -gt 0 ] || targets=(tests)  # e.g. tests/frontend/offload: only those
    PYTHONPATH="/tmp/site:/tmp/site-test:$PWD" python3 -m pytest -q -p no:cacheprovider -m gpu "${targets[@]}" ;;
  probe)  # the host: CPUs the GPU is near, their clocks, and what a bare round costs (round_cost.py)
    nproc; cat /sys/fs/cgroup/cpuset.cpus.effective 2>/dev/null || true; lscpu | grep -E "Model name|MHz|NUMA|Thread|Socket" || true
    nvidia-smi topo -m || true
    python3 -m timeit -s "import torch; t=torch.empty(64, 4096)" "t[0:32]"
    python3 benchmarks/round_cost.py --tokens 64 "${@:2}" | tee "$OUT/round_cost.json" ;;
  goal-ab)  # the goal point (Mixtral, 64 tokens) alternately for a baseline tree ($2: a worktree of an older
    # commit) and this one, eager and with CUDA graphs: on that host runs vary more than most changes gain
    for round in 1 2; do
      for variant in base eager graphs; do
        case $variant in
          base) tree=$(cd "$2" && pwd) extra=() ;;
          eager) tree=$PWD extra=(--cuda-graph-tokens 0) ;;
          graphs) tree=$PWD extra=() ;;
        esac
        mkdir -p "$OUT/$variant-$round"
        echo "# $variant, round $round"
        (cd "$tree" && PYTHONPATH="/tmp/site:$tree" python3 benchmarks/expert_fn_overhead.py --device cuda --sizes mixtral \
          --tokens 64 --seconds 1 --out "$OUT/$variant-$round" "${extra[@]}") 2>&1 | grep -E "^goal|stamp to stamp| shm | tcp "
      done
    done ;;
  call-cpu)  # issues 16/17: CPU time of a call's Python per path and of the dispatcher's per-layer work on this host's
    # CPU, for a baseline tree ($2: e.g. `git archive 33d804d | tar -x -C base` carried along) and this one (~4 min)
    python3 benchmarks/call_cpu.py --baseline-tree "${2:?give the baseline tree}" --out "$OUT" "${@:3}" ;;
  profile)  # where the goal point's time goes: torch.profiler traces of bare rounds and of the server's rounds
    mkdir -p "$OUT/traces"
    python3 benchmarks/round_cost.py --tokens 64 --trace "$OUT/traces" > "$OUT/round_cost.json"
    for round in 1 2; do
      echo "# round $round"; mkdir -p "$OUT/$round"
      KUBEMOE_TORCH_TRACE="$OUT/traces/server-$round.json" python3 benchmarks/expert_fn_overhead.py --device cuda \
        --sizes mixtral --tokens 64 --out "$OUT/$round" "${@:2}" 2>&1 | grep -E "^goal|stamp to stamp| shm "
    done
    python3 benchmarks/torch_trace.py "$OUT"/traces/*.json ;;
  predictor)  # issue 13: train the base MoE (seed 0, under 3 min), its skew against random weights, then the
    # predictors on its routing; the checkpoint stays on the machine (/tmp/moe-base), only results come back
    python3 benchmarks/train_moe.py --size base --device cuda --keep /tmp/moe-base --out "$OUT"
    python3 benchmarks/predictor_accuracy.py --checkpoint /tmp/moe-base --device cuda --out "$OUT" "${@:2}" ;;
  llapor)  # issue 15 item 2: LLaPor against gate reuse and MoEless on the base MoE's routing (retrained from seed 0)
    python3 benchmarks/llapor_accuracy.py --size base --device cuda --out "$OUT" "${@:2}" ;;
  offload)  # issue 15 item 8: every offload policy in the engine on Mixtral- and Qwen3-30B-A3B-size layers, routing
    # replayed from the base model's trace; the accelerate peer runs when its wheel is in .whl (accelerate-1.15.0)
    python3 benchmarks/offload_bench.py --device cuda --out "$OUT" "${@:2}" ;;
  offload-ab)  # issue 15: the offload bench for a baseline tree ($2: e.g. `git archive <sha> | tar -x -C base` carried
    # along, KUBEMOE_BASE_COMMIT=<sha> so its results name it) and this one, alternately, twice: this host's runs vary
    # more than most changes gain (ARGS: the bench's)
    : "${KUBEMOE_BASE_COMMIT:?set KUBEMOE_BASE_COMMIT to the sha the baseline tree was taken from}"
    for round in 1 2; do
      for variant in base this; do
        tree=$PWD commit=$KUBEMOE_COMMIT
        [ "$variant" = this ] || { tree=$(cd "${2:?give the baseline tree}" && pwd); commit=$KUBEMOE_BASE_COMMIT; }
        echo "# $variant, round $round"
        (cd "$tree" && KUBEMOE_COMMIT=$commit PYTHONPATH="/tmp/site:$tree" python3 benchmarks/offload_bench.py --device cuda \
          --out "$OUT/$variant-$round" "${@:3}") 2>&1 | grep -E " tok/s|lower bound|Error|error"
      done
    done ;;
  moeless-live)  # issue 14 item 7: kubemoe's scaling vs static EP, EPLB and the oracle over 8 expert-function
    # processes on this GPU, Mixtral-sized experts, the trained model's routing replayed; re-plans in place; every
    # plan three times in turn (one run's plans varied by a third between runs; ~5 min on the H100); with KUBEMOE_MPS=1
    # the processes share the GPU through MPS and the results go to moeless_live_mps_<machine>.json
    python3 benchmarks/moeless_live.py --device cuda --size mixtral --layers 2 --processes 8 --decode-iterations 300 \
      --prefill-iterations 60 --decode-tokens 256 --prefill-tokens 4096 --window 30 --repeats 3 --out "$OUT" "${@:2}" ;;
  dispatch-calls)  # issues 14/17: one call per expert function and layer against one per bundle; Mixtral-size experts
    # (8 experts, top-2) and Qwen3-30B-A3B-size (128, top-8) over 4 expert-function processes on this GPU (~3 min)
    python3 benchmarks/dispatch_calls.py --device cuda --layouts 8:2:mixtral,128:8:qwen3-30b-a3b --functions 4 \
      --tokens 1 32 256 --out "$OUT" "${@:2}" ;;
  frontend)  # issue 17: decode and TTFT against the roofline, transformers / in process / expert functions (shm),
    # batch 1-64, 512-token prompts, torch.profiler summaries; Mixtral sizes cut to 2 layers to fit one run
    python3 benchmarks/frontend_decode.py --device cuda --preset mixtral-4l --layers 2 --steps 20 --warmup 5 --out "$OUT" "${@:2}" ;;
  frontend-full)  # issue 17 item 5: Qwen3-30B-A3B at all 48 layers (~61 GB in bf16, generated here into /dev/shm, not
    # carried, and kept there for the next call while the machine stays warm), kubemoe in process; transformers and
    # expert functions at this depth fit one more call: ARGS --modes transformers,disaggregated --lean
    # --name frontend_full_disagg (with KUBEMOE_MPS=1, as the 2-layer goal runs: time-sliced, 3 processes' context
    # switches cost ~0.5 ms per layer at 48 layers; only the disaggregated configuration's processes join MPS)
    df -h /dev/shm /tmp | tail -2
    TMPDIR=/dev/shm python3 benchmarks/frontend_decode.py --device cuda --arch qwen3_moe --preset qwen3-30b-a3b-8l --layers 48 \
      --steps 20 --warmup 5 --modes "" --name frontend_full --checkpoint-dir /dev/shm/kubemoe-qwen3-48l --out "$OUT" "${@:2}" ;;
  frontend-mixtral)  # issue 17 item 5: Mixtral-8x7B sizes at all 32 layers (~94 GB in bf16, generated here into the
    # 128 GB /dev/shm, not carried), kubemoe in process only (as frontend-full; ~4 min); --layers N overrides
    df -h /dev/shm /tmp | tail -2
    TMPDIR=/dev/shm python3 benchmarks/frontend_decode.py --device cuda --preset mixtral-4l --layers 32 \
      --steps 20 --warmup 5 --modes "" --name frontend_mixtral --out "$OUT" "${@:2}" ;;
  decode-step)  # issue 17: a graphed decode pass's device time per op, and one MoE layer grouped vs dense (experiments/decode_step_probe.py)
    python3 benchmarks/experiments/decode_step_probe.py --device cuda --preset mixtral-4l --layers 2 --out "$OUT" "${@:2}" ;;
  engine-step)  # issue 17: where an engine decode step's time goes beyond the forward pass (experiments/engine_step_probe.py)
    python3 benchmarks/experiments/engine_step_probe.py --device cuda --preset mixtral-4l --layers 2 --out "$OUT" "${@:2}" ;;
  prefill-step)  # issue 17 item 3: where a prefill pass's time goes, per prompt length (experiments/prefill_probe.py)
    python3 benchmarks/experiments/prefill_probe.py --device cuda --preset mixtral-4l --layers 2 --out "$OUT" "${@:2}" ;;
  disagg-step)  # issue 17: where a disaggregated decode step's time goes (experiments/disagg_step_probe.py)
    python3 benchmarks/experiments/disagg_step_probe.py --device cuda --preset mixtral-4l --layers 2 --out "$OUT" "${@:2}" ;;
  replan-probe)  # issue 14: where a step stalls while the table is re-planned in place, per phase and call, over 8
    # Mixtral-sized expert-function processes on this GPU (experiments/replan_probe.py; ~1 min; ARGS: e.g.
    # --working-memory-mib 2048 for moeless_live's cap, --loads-at-once 0 for every function Loading at once)
    replan_probe --json "$OUT/replan_probe.json" "${@:2}" ;;
  replan-ab)  # issue 14: replan-probe with every function Loading at once and one at a time, twice in turn (~5 min):
    # do steps beside Loads slow down less when fewer processes Load together? (they did: frontend/replan.py)
    # ARGS go to each run
    for round in 1 2; do
      for at_once in 0 1; do
        echo "# loads at once: ${at_once/#0/all}, round $round"
        run="$OUT/replan_probe_${at_once}_$round"
        replan_probe --loads-at-once "$at_once" --json "$run.json" "${@:2}" > "$run.log" 2>&1 || { tail -20 "$run.log"; exit 1; }
        grep -A14 "^processes share" "$run.log" | grep -v "^  step\|^the .* slowest\|^a call"
      done
    done ;;
  grouped-slots)  # issue 15: one grouped FFN over the offload store's slot stack vs one FFN each (experiments/grouped_slots_probe.py)
    python3 benchmarks/experiments/grouped_slots_probe.py --device cuda --out "$OUT" "${@:2}" ;;
  step-flags)  # issue 17: a layer handed between processes by flags in device memory (experiments/step_flags_probe.py)
    python3 benchmarks/experiments/step_flags_probe.py --out "$OUT" "${@:2}" ;;
  chunked-prefill)  # issue 17 item 3: how long a 4000-token prompt stalls 8 decoding requests, chunked (budget
    # 2048, 512) against one-shot prefill; Mixtral sizes cut to 2 layers, in-process experts (~3 min)
    python3 benchmarks/chunked_prefill.py --device cuda --preset mixtral-4l --layers 2 --batch 8 --long 4000 --out "$OUT" "${@:2}" ;;
  *) echo "usage: $0 expert_fn|frontend|frontend-full|frontend-mixtral|chunked-prefill|predictor|llapor|offload|moeless-live|replan-probe|replan-ab|dispatch-calls|call-cpu|offload-ab|decode-step|engine-step|prefill-step|disagg-step|step-flags|gpu-tests|probe|profile|goal-ab BASE" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# The first thing to run on a machine with a GPU (one is enough): ~12 minutes, a summary at the end.
#
#   scripts/gpu_check.sh                 # all three parts
#   scripts/gpu_check.sh tests bench     # some of them: tests, bench, grpo, lora
#
# 1. tests   the device-parametrised tests with HFLOW_DEVICE=cuda: the engine against transformers
#            in fp32 (tests/test_engine.py, one step = one copy each way checked with CUDA's sync
#            debug mode, the KV cache sized from free memory) and bf16 (tests/test_device.py), the
#            hybrid engine's weight hand-off and log-prob parity in fp32 and bf16 on one rank
#            (tolerances 1e-4 / 0.05, tests/programs/device_hybrid.py);
# 2. bench   scripts/bench_generate.py --workload gpu-0.5b: the engine against transformers'
#            generate, bf16, Qwen2.5-0.5B's shape;
# 3. grpo    scripts/gpu_grpo_steps.py: 3 GRPO steps (actor + frozen reference, bf16) on a random
#            Qwen3-0.6B-shaped model (the shape of the CPU's bench_rl.py --model qwen3-0.6b):
#            each phase's time and memory peak, and the bf16 engine/trainer log-prob gap
#            (corrected by truncated importance sampling);
# 4. lora    the same with LoRA adapters (rank 16) on the actor: the memory and time it saves.
#
# Logs go to $HFLOW_GPU_CHECK_DIR (default outputs/gpu_check/<time>; on a lent device machine,
# HFLOW_GPU_CHECK_DIR=$OUT/gpu_check brings them back); each part has a time limit.
# Multi-rank tests are not run: NCCL takes one process per GPU.
# HFLOW_DEVICE=cpu scripts/gpu_check.sh: a dry run of the script itself on CPU (tiny sizes, a
# few tests), to check its plumbing where there is no GPU.
set -u
cd "$(dirname "$0")/.."
repo=$(pwd)
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests bench grpo lora)
out=${HFLOW_GPU_CHECK_DIR:-outputs/gpu_check/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
export PYTHONPATH="$repo/src:$repo/tests${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HFLOW_DEVICE=${HFLOW_DEVICE:-cuda}
summary=()

note() { echo "$*"; summary+=("$*"); }

run_part() {   # name, time limit (s), command...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name: $* (limit ${limit}s; log $out/$name.log)"
    timeout --kill-after 10 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    local verdict=ok
    [ "$rc" -ne 0 ] && verdict="FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', time limit'))"
    note "$name: $verdict in $((SECONDS - start)) s"
}

cpu=0
[ "$HFLOW_DEVICE" = cpu ] && cpu=1
echo "=== device"
HFLOW_CHECK_CPU=$cpu python - <<'EOF' 2>&1 | tee "$out/device.log"
import os
import torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")
if os.environ["HFLOW_CHECK_CPU"] == "1":
    raise SystemExit(print("HFLOW_DEVICE=cpu: a dry run on CPU, tiny sizes"))
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device visible: this check needs one (HFLOW_DEVICE=cpu for a dry run)")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}, bf16 {torch.cuda.is_bf16_supported()}")
EOF
if [ "${PIPESTATUS[0]}" -ne 0 ]; then
    echo "no GPU: nothing checked"
    exit 1
fi
summary+=("$(tail -n 1 "$out/device.log")")

for part in "${parts[@]}"; do
    case $part in
    tests)
        if [ $cpu = 1 ]; then select=(tests/test_device.py -k "bf16 and qwen"); else select=(tests/test_device.py tests/test_engine.py); fi
        run_part tests 330 python -m pytest -q -s -p no:cacheprovider -m "not faults" "${select[@]}"
        grep -oE "(device |[a-z0-9]+ bf16 on |[0-9]+ KV blocks on ).*" "$out/tests.log" | sed 's/^/  /' > "$out/tests.figures"
        summary+=("$(cat "$out/tests.figures")")
        summary+=("  $(grep -E "passed|failed" "$out/tests.log" | tail -n 1)")
        ;;
    bench)
        if [ $cpu = 1 ]; then workload=default; else workload=gpu-0.5b; fi
        run_part bench 240 python scripts/bench_generate.py --workload $workload --device "$HFLOW_DEVICE" --peers generate
        summary+=("$(grep -E "^ +(hflow|generate):|^hflow /" "$out/bench.log" | sed 's/^ */  /')")
        ;;
    grpo)
        if [ $cpu = 1 ]; then size=(--shape tiny --prompts 8 --samples 4 --max-tokens 32 --prompt-len 32 --eos-prob 0.05)
        else size=(--shape qwen3-0.6b); fi
        run_part grpo 330 python -m torch.distributed.run --nproc-per-node 1 scripts/gpu_grpo_steps.py \
            --steps 3 --model-dir "$out/model" "${size[@]}"
        summary+=("$(grep -E "^(step |summary)" "$out/grpo.log" | sed 's/^/  /')")
        ;;
    lora)
        if [ $cpu = 1 ]; then size=(--shape tiny --prompts 8 --samples 4 --max-tokens 32 --prompt-len 32 --eos-prob 0.05)
        else size=(--shape qwen3-0.6b); fi
        run_part lora 330 python -m torch.distributed.run --nproc-per-node 1 scripts/gpu_grpo_steps.py \
            --steps 3 --lora-rank 16 --model-dir "$out/model" "${size[@]}"
        summary+=("$(grep -E "^(step |summary)" "$out/lora.log" | sed 's/^/  /')")
        ;;
    *)
        note "unknown part $part (tests, bench, grpo, lora)"
        ;;
    esac
done

echo
echo "=== summary (logs in $out)"
printf '%s\n' "${summary[@]}" | sed '/^$/d' | tee "$out/summary.txt"

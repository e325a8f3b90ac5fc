#!/usr/bin/env bash
# The machine calibration and the validation on one CUDA GPU, unchanged apart from the device, in one command:
#
#     bash benchmarks/gpu_check.sh [OUTDIR]        # OUTDIR defaults to benchmarks/results/gpu/
#
# No network (hub access switched off), only torch, Nanotron 0.2 and what this repository ships. In order:
#   1. nvidia-smi -L, torch / CUDA / NCCL versions, whether flash-attn is installed (the runtime's Llama uses torch
#      SDPA attention either way); without a CUDA device it stops here, exit 2, with a message and nothing written;
#   2. nanotron-ext calibrate alone on the GPU: the bundled seed config and SmolLM-135M (as shipped: bf16, pp=4);
#   3. under torchrun, 2 ranks on the one GPU over gloo (NCCL refuses two ranks on one GPU): calibrate the seed
#      config and SmolLM-135M's shape at pp=2 with links, host-staged (device -> host -> gloo -> host -> device);
#   4. nanotron-ext plan and simulate --machine with each of those profiles;
#   5. nanotron-ext train on the GPU (NANOTRON_EXT_DEVICE=cuda) for 5 steps: the seed config, checked against the
#      same run on CPU, and SmolLM-135M's shape at pp=2 (tied: the host-staged tied-gradient sync too), under 1F1B
#      and under zb2p (its losses checked against 1F1B's);
#   5b. python benchmarks/measured_memory.py --device cuda: SmolLM-135M's peak memory per stage, estimate vs CUDA's
#      allocator, 1F1B and zb1p;
#   5c. python benchmarks/gpu_path_memory.py --device cuda, when upstream Nanotron main is importable (UPSTREAM_SRC,
#      default .gpu/upstream: a copy of its src/): its own Llama on the GPU against the estimate of its GPU path;
#   6. python benchmarks/predict_vs_measure.py --device cuda $PVM_ARGS (default --quick), when that script is
#      here and takes --device;
#   5d. python benchmarks/gpu_launcher.py under torchrun, world 1 over NCCL: upstream main's own run_train.py through
#      the launcher on the GPU, flash-attn's kernels stood in as in 5c, 4 steps and a checkpoint that verifies, when
#      upstream's run_train.py is at UPSTREAM_SRC (copy ../shared/upstream/nanotron/run_train.py there too);
#   6b. calibrate --in-run on the GPU (2 ranks on the one GPU, host-staged): the seed config and SmolLM-135M's shape
#      at pp=2, each block priced from real training steps (issue 41); then python benchmarks/in_run_accuracy.py
#      --device cuda $IRA_ARGS (default: --quick on seed-pp2 and smollm-pp2), the in-run profile against the engine;
#   7. OUTDIR/summary.md: the device, every step's result and log, the profiles, the training runs.
# Exit status: 0 when every step passed, 1 when one failed (the summary names it), 2 without a CUDA device.
# Environment: PYTHON (default python), STEP_TIMEOUT seconds per step (default 300), PVM_ARGS, IRA_ARGS, and
# CUDA_VISIBLE_DEVICES (default 0: one GPU). GPU_CHECK_REHEARSAL=1 rehearses the script on a machine without a GPU
# (the seed model's steps only, "cuda" replaced by CPU with the host staging forced on; the summary says so): it
# checks the script, not a GPU.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/benchmarks/results/gpu}"
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
cd "$ROOT" || exit 2

PY="${PYTHON:-python}"
STEP_TIMEOUT="${STEP_TIMEOUT:-300}"
PVM_ARGS="${PVM_ARGS:---quick}"
IRA_ARGS="${IRA_ARGS:---quick --scenario seed-pp2 --scenario smollm-pp2}"
REHEARSAL="${GPU_CHECK_REHEARSAL:-0}"
if [ "$REHEARSAL" = 1 ]; then
    DEVICE_ENV=(NANOTRON_EXT_DEVICE=cpu NANOTRON_EXT_HOST_STAGING=1)  # the CUDA path's copies, on CPU
    DEVICE=cpu
    IN_RUN_STEPS=(--steps 1 --warmup-steps 1)  # the script's check, not a profile
    ROUNDS=(--repeats 2 --warmup 1)  # likewise: 33 rounds of the seed's blocks on a CPU take a minute a calibration
else
    DEVICE_ENV=(NANOTRON_EXT_DEVICE=cuda)
    DEVICE=cuda
    IN_RUN_STEPS=()
    ROUNDS=()
fi
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network
export NANOTRON_EXT_TIMEOUT_S="${NANOTRON_EXT_TIMEOUT_S:-180}"

echo "gpu_check: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git') on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "output: $OUT; CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L
else
    echo "nvidia-smi: not found on PATH"
fi
"$PY" benchmarks/gpu_check.py env "$OUT" "$REHEARSAL" || exit $?  # no CUDA: exit 2 here, nothing written

rm -rf "$OUT/logs" "$OUT/profiles" "$OUT/plan" "$OUT/train" "$OUT/predict_vs_measure" "$OUT/configs"
rm -f "$OUT/steps.tsv" "$OUT/summary.md"
mkdir -p "$OUT/logs" "$OUT/profiles" "$OUT/plan" "$OUT/train" "$OUT/predict_vs_measure"
nvidia-smi -L > "$OUT/nvidia-smi.txt" 2>&1 || true

if command -v torchrun >/dev/null 2>&1; then TORCHRUN=(torchrun); else TORCHRUN=("$PY" -m torch.distributed.run); fi
TORCHRUN+=(--standalone --nproc_per_node=2)
NX=("$PY" -m nanotron_ext.cli)
SEED="nanotron_ext/configs/tiny_llama_large_vocab.yaml"
SMOL="nanotron_ext/configs/smollm_135m.yaml"
SMOL2="$("$PY" benchmarks/gpu_check.py configs "$OUT")" || exit 1
P="$OUT/profiles"

# step NAME CMD...: run CMD (output on the terminal and in logs/NAME.log), record its exit status in steps.tsv.
step() {
    local name=$1 start=$SECONDS rc
    shift
    echo; echo "== $name: $*"
    timeout -k 10 "$STEP_TIMEOUT" "$@" 2>&1 | tee "$OUT/logs/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && echo "gpu_check: $name ran past STEP_TIMEOUT=${STEP_TIMEOUT}s" | tee -a "$OUT/logs/$name.log"
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "logs/$name.log" "$*" >> "$OUT/steps.tsv"
}
skip() {  # skip NAME REASON
    echo; echo "== $1: skipped: $2"
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" skipped 0 - "$2" >> "$OUT/steps.tsv"
}
smollm() {  # smollm NAME CMD...: a SmolLM-sized step, skipped in a rehearsal (too slow on a CPU)
    if [ "$REHEARSAL" = 1 ]; then skip "$1" "rehearsal on CPU: SmolLM-135M is too slow there"; else step "$@"; fi
}

# 2-3. calibrate: alone (compute on the GPU), then 2 ranks on the one GPU over gloo (links host-staged).
# The one device rule: every step names its device (--device, or NANOTRON_EXT_DEVICE for train).
step calibrate_seed_alone "${NX[@]}" calibrate "$SEED" --device "$DEVICE" "${ROUNDS[@]}" --out "$P/seed_alone.json"
smollm calibrate_smollm_alone "${NX[@]}" calibrate "$SMOL" --device "$DEVICE" --out "$P/smollm_135m_alone.json"
step calibrate_seed_pp2_gloo "${TORCHRUN[@]}" -m nanotron_ext.cli calibrate "$SEED" --backend gloo \
    --device "$DEVICE" "${ROUNDS[@]}" --out "$P/seed_pp2_gloo_host_staged.json"
smollm calibrate_smollm_pp2_gloo "${TORCHRUN[@]}" -m nanotron_ext.cli calibrate "$SMOL2" --backend gloo \
    --device "$DEVICE" --out "$P/smollm_135m_pp2_gloo_host_staged.json"

# 4. plan and simulate with each profile.
for run in "seed:$SEED:seed_pp2_gloo_host_staged" "smollm_alone:$SMOL:smollm_135m_alone" \
           "smollm_pp2:$SMOL2:smollm_135m_pp2_gloo_host_staged"; do
    IFS=: read -r name config profile <<< "$run"
    run_step=step
    [ "$name" = seed ] || run_step=smollm
    $run_step "plan_$name" "${NX[@]}" plan "$config" --machine "$P/$profile.json"
    $run_step "simulate_$name" "${NX[@]}" simulate "$config" --machine "$P/$profile.json" --out "$OUT/plan/$name.png"
done

# 5. the CPU runtime on the GPU, 2 ranks on the one GPU: the seed model (and the same run on CPU), SmolLM pp=2.
TRAIN=(-m nanotron_ext.cli train --steps 5)
step train_seed_cpu env NANOTRON_EXT_DEVICE=cpu "${TORCHRUN[@]}" "${TRAIN[@]}" --config-file "$SEED" \
    --metrics-out "$OUT/train/seed_cpu.json"
step train_seed_cuda env "${DEVICE_ENV[@]}" "${TORCHRUN[@]}" "${TRAIN[@]}" --config-file "$SEED" \
    --metrics-out "$OUT/train/seed_cuda.json" --plan-out "$OUT/plan/seed_trained_plan.json"
step compare_seed_cuda_cpu "$PY" benchmarks/gpu_check.py compare "$OUT"
smollm train_smollm_pp2_cuda env "${DEVICE_ENV[@]}" "${TORCHRUN[@]}" "${TRAIN[@]}" --config-file "$SMOL2" \
    --metrics-out "$OUT/train/smollm_135m_pp2_cuda.json"
# 5a. zb2p on the GPU (issue 31): the same run under the zero-bubble engine, its losses 1F1B's.
smollm train_smollm_pp2_zb2p_cuda env "${DEVICE_ENV[@]}" "${TORCHRUN[@]}" "${TRAIN[@]}" \
    --config-file "${SMOL2%.yaml}_zb2p.yaml" --metrics-out "$OUT/train/smollm_135m_pp2_zb2p_cuda.json"
smollm compare_smollm_zb2p_1f1b_cuda "$PY" benchmarks/gpu_check.py compare "$OUT" smollm_135m_pp2_zb2p_cuda \
    smollm_135m_pp2_cuda

# 5b. peak memory on the GPU against the estimate (issue 30): SmolLM-135M at pp=2, bf16/fp32, 1F1B/zb1p.
smollm measured_memory_cuda "$PY" benchmarks/measured_memory.py --device cuda \
    --out "$OUT/train/measured_memory_cuda.json"

# 6. predicted vs measured step times, on the GPU (issue 22's validation).
# 5c. upstream Nanotron's own Llama (flash-attn's tensors kept by stand-in kernels) against the GPU path's estimate.
UPSTREAM_SRC="${UPSTREAM_SRC:-$ROOT/.gpu/upstream}"
if [ ! -d "$UPSTREAM_SRC/nanotron" ]; then
    skip gpu_path_memory "no upstream Nanotron at $UPSTREAM_SRC (copy ../shared/upstream/nanotron/src there)"
else
    smollm gpu_path_memory env PYTHONPATH="$UPSTREAM_SRC:$PYTHONPATH" "$PY" benchmarks/gpu_path_memory.py \
        --device cuda --out "$OUT/train/gpu_path_memory_cuda.json"
fi

# 5d. the launcher itself on the GPU (issue 41): upstream's run_train.py, world 1 over NCCL.
if [ "$REHEARSAL" = 1 ]; then
    skip launcher_cuda "rehearsal on CPU: the launcher runs there with --cpu-debug (tests/upstream)"
elif [ ! -f "$UPSTREAM_SRC/run_train.py" ]; then
    skip launcher_cuda "no upstream run_train.py at $UPSTREAM_SRC (copy ../shared/upstream/nanotron/run_train.py there)"
else
    step launcher_cuda env PYTHONPATH="$UPSTREAM_SRC:$PYTHONPATH" "${TORCHRUN[@]/--nproc_per_node=2/--nproc_per_node=1}" \
        benchmarks/gpu_launcher.py "$UPSTREAM_SRC/run_train.py" "$OUT/launcher"
fi

PVM=benchmarks/predict_vs_measure.py
if [ "$REHEARSAL" = 1 ]; then
    skip predict_vs_measure "rehearsal on CPU: run python $PVM itself there"
elif [ ! -f "$PVM" ]; then
    skip predict_vs_measure "$PVM is not in this checkout"
elif ! "$PY" "$PVM" --help 2>/dev/null | grep -q -- "--device"; then
    skip predict_vs_measure "$PVM does not take --device yet"
else
    marker="$OUT/predict_vs_measure/.start"
    touch "$marker"
    # shellcheck disable=SC2086  # PVM_ARGS is a list of flags
    step predict_vs_measure "$PY" "$PVM" --device cuda $PVM_ARGS
    find benchmarks/results -maxdepth 1 -name 'predict_vs_measure*' -newer "$marker" \
        -exec cp {} "$OUT/predict_vs_measure/" \;
    rm -f "$marker"
fi

# 6b. the in-run profile on the GPU (issue 41): blocks priced from real training steps, 2 ranks on the one GPU.
step calibrate_seed_in_run "${TORCHRUN[@]}" -m nanotron_ext.cli calibrate "$SEED" --in-run --probes \
    "${IN_RUN_STEPS[@]}" --device "$DEVICE" --machine "$P/seed_pp2_gloo_host_staged.json" --out "$P/seed_pp2_in_run.json"
smollm calibrate_smollm_pp2_in_run "${TORCHRUN[@]}" -m nanotron_ext.cli calibrate "$SMOL2" --in-run \
    --device "$DEVICE" --machine "$P/smollm_135m_pp2_gloo_host_staged.json" --out "$P/smollm_135m_pp2_in_run.json"
if [ "$REHEARSAL" = 1 ]; then
    skip in_run_accuracy "rehearsal on CPU: run python benchmarks/in_run_accuracy.py itself there"
else
    # shellcheck disable=SC2086  # IRA_ARGS is a list of flags
    step in_run_accuracy "$PY" benchmarks/in_run_accuracy.py --device cuda $IRA_ARGS \
        --out "$OUT/in_run_accuracy_cuda.json"
fi

# 7. the summary (exit 1 when a step failed).
echo
"$PY" benchmarks/gpu_check.py summary "$OUT"
rc=$?
echo; echo "gpu_check: summary in $OUT/summary.md"
exit $rc

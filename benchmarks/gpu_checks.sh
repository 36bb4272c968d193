#!/usr/bin/env bash
# The checks for a GPU machine, in two parts each meant for one call of a lent GPU, most important
# first, every stage bounded in time so that one that hangs leaves time to the rest (the train
# part's bounds add up to 740 s, over a call's 600 s: a call cut short loses its last stage):
#
#     benchmarks/gpu_checks.sh train   [OUTDIR]   the train engine: MFU against a plain HF step
#                                                 (0.5B and 1.5B shapes), then `make test-gpu`'s tests,
#                                                 then MFU with compiled decoder layers
#     benchmarks/gpu_checks.sh rollout [OUTDIR]   generation against HF generate, the GRPO step
#                                                 against TRL (sync, async in process, async with
#                                                 our server beside the trainer), a weight update
#                                                 into that server by disk and by CUDA IPC handles
#     benchmarks/gpu_checks.sh all     [OUTDIR]   both
#     benchmarks/gpu_checks.sh train_mfu,generation [OUTDIR]   any stages by name, in the order of the script
#
# TEST_FILTER=EXPR runs only the GPU tests ``-k EXPR`` selects (TEST_LIMIT: that stage's seconds).
# Each stage's whole log goes to OUTDIR/<stage>.log (default gpu-checks/); the end of each is
# printed here, and every RESULT line again at the end. It runs from the repository without
# installing it (PYTHONPATH), with whatever Python has torch with CUDA and the package's
# dependencies (`trl` for the GRPO stage); PY=python chooses the Python.
# MODEL_DIR (default .gpu/smollm2-config) is SmolLM2-135M-Instruct's config and tokenizer without
# weights (the benchmarks draw random ones: same shapes, same work), for a GPU machine that cannot
# have the model itself; where `make real-model` has built the full directory, pass that instead.
# Made on a machine with the model, to carry to one without (.gpu/ is ignored by git):
#     d=$(.venv/bin/python -m areal_lite.utils.pretrained smollm2)
#     mkdir -p .gpu/smollm2-config && cp "$d"/*.json "$d"/*.jinja .gpu/smollm2-config/
set -u
PART=${1:-all}
case $PART in
    train) PART=train_mfu,test_gpu,train_compile ;;
    rollout) PART=generation,grpo_smollm2,weight_handover ;;
    all) PART=train_mfu,test_gpu,train_compile,generation,grpo_smollm2,weight_handover ;;
esac
OUTDIR=${2:-gpu-checks}
PY=${PY:-python3}
MODEL_DIR=${MODEL_DIR:-.gpu/smollm2-config}
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

stage() {
    local name=$1 limit=$2 start rc
    shift 2
    case ",$PART," in *",$name,"*) ;; *) return ;; esac
    echo "=== $name (limit ${limit} s): $*"
    start=$(date +%s)
    timeout -k 10 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
    rc=$?
    echo "--- $name: rc=$rc in $(($(date +%s) - start)) s"
    tail -n "${TAIL:-20}" "$OUTDIR/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

# Liger's kernels as a second row of ours where the liger extra is installed (its wheels carried)
VARIANT=()
"$PY" -c "import liger_kernel" 2> /dev/null && VARIANT=(--variant liger_kernels=true)
stage train_mfu 300 "$PY" benchmarks/train_mfu.py --device cuda --shapes 0.5b,1.5b --warmup 2 --steps 3 --sync-report \
    "${VARIANT[@]}"
TAIL=40 stage test_gpu "${TEST_LIMIT:-200}" env OMP_NUM_THREADS=1 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
    --timeout 170 -rfEs ${TEST_FILTER:+-k "$TEST_FILTER"}
# torch.compile of the decoder layers (compile_layers), a row beside the default on both shapes;
# its warm-up steps pay the compilation
stage train_compile 240 "$PY" benchmarks/train_mfu.py --device cuda --shapes 0.5b,1.5b --warmup 2 --steps 3 \
    --variant compile_layers=true
stage generation 120 env OMP_NUM_THREADS=4 "$PY" benchmarks/generation.py --device cuda --dtype bfloat16 \
    --skip-sync --model "$MODEL_DIR" --repeats 2
stage grpo_smollm2 240 "$PY" benchmarks/grpo_vs_trl.py --device cuda --dtype bfloat16 --model "$MODEL_DIR" \
    --threads-list 4 --prompts 4 --group 8 --tokens 64 --steps 3 --warmup 2
stage weight_handover 90 env OMP_NUM_THREADS=4 "$PY" benchmarks/weight_handover.py --device cuda --repeats 2
echo "=== RESULT lines"
grep -h "^RESULT" "$OUTDIR"/*.log

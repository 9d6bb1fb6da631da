#!/usr/bin/env bash
# Every GPU-only check of the project, in stages that each fit one device call (<10 min).
#   bash tests/gpu/run_all.sh kernels   # kernel + inference checks, tests/fusions on the GPU
#   bash tests/gpu/run_all.sh bench     # tools/benchmark.py
#   bash tests/gpu/run_all.sh layer     # GatedDeltaNet with FLA's kernels: 1 GPU, then TP=2 (NCCL)
#   bash tests/gpu/run_all.sh example   # the pretraining example, flag off vs on, TP=1 (and TP=2)
# Several stages may be named in one call; STEP_TIMEOUT (s) bounds each step; TP_SIZES ("1 2")
# picks the tensor-parallel sizes of the layer and example stages.
# Wheels (megatron-core, fla-core, and triton 3.7.1 for FLA's GDN backward on Hopper) are
# installed into .site first when .whl/ holds them (tests/gpu/README.md: how to fill it).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out/gpu}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null && [[ ! -f .site/.installed ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target .site .whl/*.whl && touch .site/.installed
fi
export PYTHONPATH="$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Logs survive a timeout (unbuffered), a timeout prints where Python was (SIGABRT ->
# faulthandler), FLA's first-call autotuning is visible and kept on disk for the next step.
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TRITON_PRINT_AUTOTUNING=1 TRITON_CACHE_AUTOTUNING=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
step() {  # step NAME CMD...: run, keep going, remember failures
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout -s ABRT -k 20 "${STEP_TIMEOUT:-590}" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    [[ $rc -eq 0 ]] || status=1
}
tp_wanted() { [[ " ${TP_SIZES:-1 2} " == *" $1 "* ]]; }  # TP_SIZES="1" or "2" picks
for stage in "${@:-kernels}"; do
case "$stage" in
kernels)
    step check_kernels python3 tests/gpu/check_kernels.py
    step check_inference python3 tests/gpu/check_inference.py
    step pytest_fusions python3 -m pytest -q -p no:cacheprovider tests/fusions
    ;;
bench)
    step benchmark python3 tools/benchmark.py --out "$OUT/benchmark" ${BENCH_ARGS:-}
    ;;
layer)
    if tp_wanted 1; then
        step check_gdn_layer python3 tests/gpu/check_gdn_layer.py
    fi
    if tp_wanted 2 && [[ $ngpu -ge 2 ]]; then
        step check_gdn_layer_tp2 torchrun --nproc-per-node 2 tests/gpu/check_gdn_layer.py --tp 2
    fi
    ;;
example)
    if tp_wanted 1; then
        step example_tp1 python3 examples/pretrain_gdn.py --compare --no-progress --out "$OUT/example_tp1" ${EXAMPLE_ARGS:-}
    fi
    if tp_wanted 2 && [[ $ngpu -ge 2 ]]; then
        step example_tp2 python3 examples/pretrain_gdn.py --compare --no-progress --tp 2 --sequence-parallel --recompute-norm --out "$OUT/example_tp2" ${EXAMPLE_ARGS:-}
    fi
    ;;
*)
    echo "unknown stage $stage"; status=1
    ;;
esac
done
exit $status

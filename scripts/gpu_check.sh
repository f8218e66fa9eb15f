#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA GPU (no install: the source tree on
# PYTHONPATH; torch with CUDA, and optionally CuPy, mpi4py + Open MPI already there):
#   scripts/gpu_check.sh [bench] [tests] [ddp] [cpu]     (default: bench tests ddp)
# tests: tests/test_gpu.py; bench: tensorwire against Gloo (and NCCL where it runs) on CUDA
# tensors, 2 ranks, then TCP-forced (staged); ddp: examples/ddp_train.py on the GPU, tensorwire
# and Gloo; cpu: the host collectives at 8 and 16 ranks against Gloo and Open MPI.
# Logs go to $OUT (or ./gpu-check-out); a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PYTHON:-python3}
steps=${*:-bench tests ddp}
TESTS_S=${TESTS_S:-420}  # bounds of each step, seconds
BENCH_S=${BENCH_S:-300}
PER_TEST_S=${PER_TEST_S:-300}
summary=()
note() { summary+=("$*"); echo "== $*"; }

(nvidia-smi; nproc; $PY -c 'import torch, numpy; print("torch", torch.__version__, "cuda",
 torch.version.cuda, "numpy", numpy.__version__)') 2>&1 | tee "$OUT/machine.txt"

for step in $steps; do
  case $step in
  tests)
    timeout "$TESTS_S" $PY -m pytest -q -p no:cacheprovider -rfE --timeout "$PER_TEST_S" tests/test_gpu.py \
      > "$OUT/tests.log" 2>&1
    note "tests: rc=$? $(tail -1 "$OUT/tests.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
    ;;
  bench)
    TENSORWIRE_DEBUG=INFO TENSORWIRE_DEBUG_SUBSYS=INIT \
    timeout "$BENCH_S" $PY -m tensorwire.benchmarks.cuda all -b 8 -e 64M -f 64 --np 2 --compare gloo,nccl \
      > "$OUT/bench-cuda-n2.txt" 2>&1
    note "bench n=2 (rc=$?):"; grep -v "\[tensorwire " "$OUT/bench-cuda-n2.txt"
    grep -m2 "on CUDA" "$OUT/bench-cuda-n2.txt"
    TENSORWIRE_TRANSPORT=tcp timeout 120 $PY -m tensorwire.benchmarks.cuda all_reduce -b 1M -e 64M -f 64 \
      --np 2 --compare gloo > "$OUT/bench-cuda-n2-tcp.txt" 2>&1
    note "bench n=2 TCP-forced, staged (rc=$?):"; cat "$OUT/bench-cuda-n2-tcp.txt"
    ;;
  ddp)
    for backend in tensorwire gloo; do
      timeout 120 $PY -m torch.distributed.run --nproc-per-node 2 --master-port 29517 examples/ddp_train.py \
        --device cuda --backend "$backend" --steps 40 --hidden 2048 > "$OUT/ddp-$backend.txt" 2>&1
      note "ddp $backend (rc=$?): $(grep -E 'ms a step' "$OUT/ddp-$backend.txt")"
    done
    ;;
  cpu)
    for n in 8 16; do
      timeout 200 $PY -m tensorwire.cli bench all -b 8 -e 16M -f 64 -n auto -w auto --np $n \
        --compare gloo,mpi --rounds 2 > "$OUT/bench-cpu-n$n.txt" 2>&1
      note "cpu bench n=$n (rc=$?): see bench-cpu-n$n.txt"
    done
    ;;
  esac
done
echo; echo "== summary"; printf '%s\n' "${summary[@]}"

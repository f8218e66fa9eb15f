#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA GPU (no install: the source tree on
# PYTHONPATH; torch with CUDA, and optionally CuPy, mpi4py + Open MPI already there):
#   scripts/gpu_check.sh [bench] [tests] [p2p] [flags] [ddp] [pipeline] [mps] [cpu] [tcp] [tcpprof] [profile]
#   (default: bench tests ddp)
# tests: tests/test_gpu.py, less what the p2p and flags steps ran before it; bench: tensorwire
# against Gloo (and NCCL where it runs) on CUDA tensors, 2 ranks, 8 B to 2 MiB and 64 MiB, then
# TCP-forced (staged); p2p: the point-to-point tests of tests/test_gpu.py, then ping-pong device
# to device and staged (TENSORWIRE_CUDA_IPC=0), 8 B to 64 MiB, and the pipeline example on the GPU
# both ways; flags: the device-flag tests (forced without MPS unless `tests` ran first, then chosen
# by auto under MPS) and 8 B to 1 MiB all_reduces, broadcasts and all_gathers under MPS with the
# device flags and without (TENSORWIRE_CUDA_DEVICE_FLAGS=1/0; with them, also replayed from a CUDA
# graph; without, the ping-pong too), Gloo beside; ddp: examples/ddp_train.py on the GPU,
# tensorwire and Gloo; pipeline: examples/pipeline_train.py, 2 stages on the GPU (send/recv of
# CUDA tensors; Gloo cannot send them), 4 stages on CPU against Gloo; mps: the 8 B and 64 MiB
# bench again under CUDA MPS (a control daemon of this script's own, stopped after; where
# nvidia-cuda-mps-control exists); cpu: the host collectives at 8 and 16 ranks against Gloo and
# Open MPI (JSON and markdown tables too); tcp: the machine's raw TCP ceiling with sendrecv beside
# it, then 64 MiB all_reduce over TCP against Gloo at 2 and 8 ranks, then all_reduce and sendrecv
# at 2 ranks for each streams per pair x pump threads; profile: py-spy (where on PATH: carry its
# wheel) on both ranks of the 8 B CUDA all_reduce and ping-pong, on CPU and with --idle, as raw
# stacks (flamegraph.pl's input); tcpprof: the machine's TCP settings and py-spy on both ranks of
# the host's 64 MiB all_reduce over loopback TCP.
# BUDGET_S (seconds, default 540, 0 = none) bounds the whole run: each step's timeout is cut to
# what is left, and a step that would start with under a minute left is skipped. Rough wall
# times on the H200 machine: tests 150-250 s, p2p 150-250, flags 200-350, tcp 200-300, cpu
# 150-340, bench 150-250, tcpprof under 10, plus a ~15 s preamble: two or three steps a call.
# The compiled module is built first where this Python has none (setup.py, else the compiler
# directly); one built elsewhere for the same Python can be carried in src/tensorwire/transport/.
# Logs go to $OUT/logs (or ./gpu-check-out/logs), packed into $OUT/gpu-check-logs.tgz at exit
# beside summary.txt (the device tool brings back few files); a short table is printed last.
# Exits 1 where any step did not succeed (its rc in the summary), else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
PY=${PYTHON:-python3}
steps=${*:-bench tests ddp}
TESTS_S=${TESTS_S:-420}  # bounds of each step, seconds
BENCH_S=${BENCH_S:-300}
CPU_S=${CPU_S:-120}  # each CPU sweep: ~30-50 s on 16 cores
PER_TEST_S=${PER_TEST_S:-120}
BUDGET_S=${BUDGET_S:-540}  # under the device tool's 600 s a command
summary=()
failed=0  # the exit status: 1 where any step's rc was not 0
note() { summary+=("$*"); echo "== $*"; if [[ "$*" =~ rc=[1-9] ]]; then failed=1; fi; }
left() { echo $(( BUDGET_S > 0 ? BUDGET_S - SECONDS : 1000000 )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : (l > 1 ? l : 1) )); }  # a timeout within the budget
pack() {
  printf '%s\n' "${summary[@]}" > "$OUT/summary.txt"
  tar czf "$OUT/gpu-check-logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
}
trap pack EXIT
trap 'exit 143' TERM INT

mps_on() {  # a CUDA MPS control daemon of this script's own, for the steps that want one
  if ! command -v nvidia-cuda-mps-control > /dev/null; then note "no nvidia-cuda-mps-control: MPS skipped"; return 1; fi
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/tw-mps CUDA_MPS_LOG_DIRECTORY=/tmp/tw-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && sleep 1
}
mps_off() {
  echo quit | nvidia-cuda-mps-control; sleep 1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

native_built() { $PY -c 'import tensorwire.transport._native' 2> /dev/null; }
if ! native_built; then  # the compiled module for this Python: setup.py, else the compiler directly
  timeout 120 $PY setup.py -q build_ext --inplace > "$LOGS/native-build.log" 2>&1 || {
    inc=$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
    ext=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    timeout 120 cc -O3 -DNDEBUG -fPIC -shared -I"$inc" src/tensorwire/transport/_native.c \
      src/tensorwire/transport/_caller.c -o "src/tensorwire/transport/_native$ext" >> "$LOGS/native-build.log" 2>&1
  }
fi
native_built && note "compiled module: loaded" || note "compiled module: MISSING, the CPU steps time the Python path"
host=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -1 | grep -o 'H[0-9]\+' | tr H h)
host=${host:-gpu}host  # names the CPU sweep's tables, as docs/benchmarks/compare-n16-h200host.md

(nvidia-smi; nproc; $PY -c 'import torch, numpy; print("torch", torch.__version__, "cuda",
 torch.version.cuda, "numpy", numpy.__version__); import triton; print("triton", triton.__version__)') 2>&1 | tee "$LOGS/machine.txt"

for step in $steps; do
  if [ "$(left)" -lt 60 ]; then note "$step: skipped, the budget is spent"; continue; fi
  case $step in
  tests)
    timeout -k 10 "$(cap $TESTS_S)" $PY -m pytest -v -p no:cacheprovider -rfE --timeout "$PER_TEST_S" tests/test_gpu.py \
      ${ran_k:+-k "not ($ran_k)"} > "$LOGS/tests.log" 2>&1
    note "tests: rc=$? $(tail -1 "$LOGS/tests.log")"
    gpu_tests_ran=1  # the p2p and flags steps then skip their plain test runs
    grep -E "^(FAILED|ERROR)" "$LOGS/tests.log" | head -20
    ;;
  bench)
    for sizes in "-b 8 -e 2M -f 64" "-b 64M -e 64M"; do
      TENSORWIRE_DEBUG=INFO TENSORWIRE_DEBUG_SUBSYS=INIT \
      timeout -k 10 "$(cap $BENCH_S)" $PY -m tensorwire.tools.benchmarks.cuda all $sizes --np 2 --compare gloo,nccl \
        >> "$LOGS/bench-cuda-n2.txt" 2>&1
      note "bench n=2 $sizes (rc=$?)"
    done
    grep -v "\[tensorwire " "$LOGS/bench-cuda-n2.txt"; grep -m2 "on CUDA" "$LOGS/bench-cuda-n2.txt"
    TENSORWIRE_TRANSPORT=tcp timeout -k 10 "$(cap 120)" $PY -m tensorwire.tools.benchmarks.cuda all_reduce -b 1M -e 64M -f 64 \
      --np 2 --compare gloo > "$LOGS/bench-cuda-n2-tcp.txt" 2>&1
    note "bench n=2 TCP-forced, staged (rc=$?):"; cat "$LOGS/bench-cuda-n2-tcp.txt"
    ;;
  ddp)
    for backend in tensorwire gloo; do
      timeout -k 10 "$(cap 120)" $PY -m torch.distributed.run --nproc-per-node 2 --master-port 29517 examples/ddp_train.py \
        --device cuda --backend "$backend" --steps 40 --hidden 2048 > "$LOGS/ddp-$backend.txt" 2>&1
      note "ddp $backend (rc=$?): $(grep -E 'ms a step' "$LOGS/ddp-$backend.txt")"
    done
    ;;
  p2p)
    if [ -z "${gpu_tests_ran:-}" ]; then
      timeout -k 10 "$(cap $TESTS_S)" $PY -m pytest -v -p no:cacheprovider -rfE --timeout "$PER_TEST_S" tests/test_gpu.py \
        -k "point_to_point or device-send" > "$LOGS/p2p-tests.log" 2>&1
      note "p2p tests: rc=$? $(tail -1 "$LOGS/p2p-tests.log")"
      ran_k="${ran_k:+$ran_k or }point_to_point or device-send"
      grep -E "^(FAILED|ERROR)" "$LOGS/p2p-tests.log" | head -20
    fi
    for ipc in 1 0; do  # staged alike up to 1 MiB on one GPU without MPS (p2p.staged_faster): 0 from 1 MiB
      TENSORWIRE_CUDA_IPC=$ipc timeout -k 10 "$(cap $BENCH_S)" $PY -m tensorwire.tools.benchmarks.cuda pingpong \
        $([ $ipc = 1 ] && echo -b 8 || echo -b 1M) -e 64M -f 8 --np 2 --compare "$([ $ipc = 1 ] && echo nccl)" \
        > "$LOGS/bench-pingpong-ipc$ipc.txt" 2>&1
      note "pingpong TENSORWIRE_CUDA_IPC=$ipc (rc=$?):"; grep -v "\[tensorwire " "$LOGS/bench-pingpong-ipc$ipc.txt"
      TENSORWIRE_CUDA_IPC=$ipc timeout -k 10 "$(cap 120)" $PY -m torch.distributed.run --nproc-per-node 2 --master-port 29519 \
        examples/pipeline_train.py --backend tensorwire --steps 40 --device cuda --hidden 2048 --micro-batch 256 \
        > "$LOGS/pipeline-ipc$ipc.txt" 2>&1  # 2 MiB activations: past what stages anyway
      note "pipeline 2 stages on the GPU, TENSORWIRE_CUDA_IPC=$ipc (rc=$?): $(grep -E 'ms a step' "$LOGS/pipeline-ipc$ipc.txt")"
    done
    ;;
  pipeline)
    for run in "tensorwire 2 --device cuda --hidden 2048" "tensorwire 4" "gloo 4"; do
      set -- $run
      timeout -k 10 "$(cap 120)" $PY -m torch.distributed.run --nproc-per-node "$2" --master-port 29518 examples/pipeline_train.py \
        --backend "$1" --steps 40 "${@:3}" > "$LOGS/pipeline-$1-$2.txt" 2>&1
      note "pipeline $run (rc=$?): $(grep -E 'ms a step' "$LOGS/pipeline-$1-$2.txt")"
    done
    ;;
  mps)
    mps_on || continue
    for size in 8 64M; do
      timeout -k 10 "$(cap 60)" $PY -m tensorwire.tools.benchmarks.cuda all -b $size -e $size --np 2 --compare gloo \
        >> "$LOGS/bench-cuda-n2-mps.txt" 2>&1
      note "bench n=2 under MPS, $size (rc=$?)"
    done
    mps_off
    grep -v "\[tensorwire " "$LOGS/bench-cuda-n2-mps.txt"
    ;;
  flags)
    flag_tests() {  # $1: the log's name, $2: -k (tests/test_device_flags.py is Triton's CPU interpreter: not here)
      timeout -k 10 "$(cap $TESTS_S)" $PY -m pytest -v -p no:cacheprovider -rfE --timeout "$PER_TEST_S" \
        tests/test_gpu.py -k "$2" > "$LOGS/$1.log" 2>&1
      note "$1: rc=$? $(tail -1 "$LOGS/$1.log")"
      grep -E "^(FAILED|ERROR)" "$LOGS/$1.log" | head -20
    }
    flagged="device_flags or device-flags or cuda_graph"
    if ! mps_on; then  # the tests force the flags where kernels time-slice
      if [ -z "${gpu_tests_ran:-}" ]; then flag_tests flags-tests "$flagged"; ran_k="${ran_k:+$ran_k or }$flagged"; fi
      continue
    fi
    # under MPS, where auto picks them; a peer lost mid-kernel is left to the tests without MPS
    flag_tests flags-tests-mps "($flagged) and not lost_peer"
    for flags in 1 0; do
      TENSORWIRE_CUDA_DEVICE_FLAGS=$flags TENSORWIRE_DEBUG=INFO TENSORWIRE_DEBUG_SUBSYS=INIT timeout -k 10 "$(cap $BENCH_S)" \
        $PY -m tensorwire.tools.benchmarks.cuda all_reduce broadcast all_gather $([ $flags = 0 ] && echo pingpong) \
        -b 8 -e 1M -f 16 --np 2 \
        --compare "$([ $flags = 1 ] && echo gloo)" $([ $flags = 1 ] && echo --graph) > "$LOGS/bench-flags$flags-mps.txt" 2>&1
      note "all_reduce n=2 under MPS, TENSORWIRE_CUDA_DEVICE_FLAGS=$flags (rc=$?): $(grep -m1 -o 'small calls: [a-z ]*' "$LOGS/bench-flags$flags-mps.txt")"
      grep -v "\[tensorwire " "$LOGS/bench-flags$flags-mps.txt"
    done
    mps_off
    ;;
  profile)
    if ! command -v py-spy > /dev/null; then note "profile: no py-spy"; continue; fi
    for run in "all_reduce 30000" "pingpong 3000"; do
      set -- $run
      for how in oncpu idle; do
        timeout -k 10 "$(cap 60)" py-spy record --subprocesses --nonblocking -r 400 -f raw -o "$LOGS/spy-$1-8B-$how.txt" \
          $([ $how = idle ] && echo --idle) -- $PY -m tensorwire.tools.benchmarks.cuda $1 -b 8 -e 8 -n $2 \
          --np 2 --compare '' > "$LOGS/spy-$1-8B-$how.log" 2>&1
        note "profile 8 B $1, $how (rc=$?): $(grep -c . "$LOGS/spy-$1-8B-$how.txt" 2>/dev/null) stacks"
      done
    done
    ;;
  tcpprof)
    (lscpu | head -20; for f in /proc/sys/net/ipv4/tcp_rmem /proc/sys/net/ipv4/tcp_wmem /proc/sys/net/core/rmem_max \
      /proc/sys/net/core/wmem_max /proc/sys/net/ipv4/tcp_congestion_control /sys/class/net/lo/mtu; do
      echo "$f: $(cat "$f" 2>/dev/null)"; done) > "$LOGS/tcp-machine.txt" 2>&1
    note "tcp settings: $(grep -E 'Model name|^CPU\(s\)' "$LOGS/tcp-machine.txt" | tr -s ' ' | tr '\n' ';') $(grep -E 'rmem|wmem|mtu' "$LOGS/tcp-machine.txt" | tr '\n' ';')"
    if ! command -v py-spy > /dev/null; then note "tcpprof: no py-spy"; continue; fi
    timeout -k 10 "$(cap 90)" py-spy record --subprocesses --nonblocking -r 200 -f raw -o "$LOGS/spy-tcp64M.txt" -- \
      $PY -m tensorwire.tools.cli bench all_reduce -b 64M -e 64M -I --np 2 --tcp -n 40 -w 3 > "$LOGS/spy-tcp64M.log" 2>&1
    note "profile tcp 64 MiB all_reduce (rc=$?): $(grep -E '^ +67108864' "$LOGS/spy-tcp64M.log")"
    ;;
  cpu)
    for n in 8 16; do
      timeout -k 10 "$(cap $CPU_S)" $PY -m tensorwire.tools.cli bench all -b 8 -e 16M -f 64 -n auto -w auto --np $n \
        --compare gloo,mpi --rounds $(( n == 8 ? 2 : 1 )) --json "$LOGS/compare-n$n-$host.json" \
        --markdown "$LOGS/compare-n$n-$host.md" > "$LOGS/bench-cpu-n$n.txt" 2>&1
      note "cpu bench n=$n (rc=$?): $(grep -c geometric "$LOGS/bench-cpu-n$n.txt") collectives, see bench-cpu-n$n.txt"
    done
    timeout -k 10 "$(cap $CPU_S)" $PY -m tensorwire.tools.cli bench reduce --algo all -b 32K -e 8M -f 16 -I --np 8 \
      > "$LOGS/bench-cpu-reduce-n8.txt" 2>&1
    note "cpu reduce n=8, every algorithm (rc=$?): $(grep -o 'auto .*' "$LOGS/bench-cpu-reduce-n8.txt" | tr '\n' ';')"
    ;;
  tcp)
    tw="$PY -m tensorwire.tools.cli bench"
    timeout -k 10 "$(cap 150)" $tw sendrecv -b 64M -e 64M --np 2 --tcp --tcp-ceiling -n 10 -w 3 > "$LOGS/bench-tcp-ceiling.txt" 2>&1
    note "tcp ceiling (rc=$?):"; grep -E "^#   +[0-9]|of one raw socket" "$LOGS/bench-tcp-ceiling.txt"
    for np in 2 8; do
      timeout -k 10 "$(cap 240)" $tw all_reduce -b 64M -e 64M -I --np $np --tcp -n 5 -w 2 --rounds 2 --compare gloo \
        > "$LOGS/bench-tcp-n$np.txt" 2>&1
      note "tcp n=$np 64 MiB against Gloo, default threads (rc=$?): $(grep -E '^ +67108864' "$LOGS/bench-tcp-n$np.txt")"
    done
    for ns in 1 2 4; do
      for th in 0 auto 8; do
        for coll in "all_reduce -I" sendrecv; do
          [ "$(left)" -lt 30 ] && break 3
          TENSORWIRE_NSOCKS=$ns TENSORWIRE_SOCKET_THREADS=$th timeout -k 10 "$(cap 60)" $tw $coll -b 64M -e 64M --np 2 --tcp \
            -n 10 -w 3 > "$LOGS/tcp.tmp" 2>&1
          note "tcp n=2 64 MiB $coll NSOCKS=$ns THREADS=$th (rc=$?): $(grep -E '^ +67108864' "$LOGS/tcp.tmp")"
          cat "$LOGS/tcp.tmp" >> "$LOGS/bench-tcp-n2-pumps.txt"
        done
      done
    done
    rm -f "$LOGS/tcp.tmp"
    ;;
  *) note "$step: no such step" ;;
  esac
done
echo; echo "== summary"; printf '%s\n' "${summary[@]}"
exit "$failed"

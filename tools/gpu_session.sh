#!/usr/bin/env bash
# Everything a GPU machine is wanted for, in one call, each part under its own time limit so that one part that
# hangs or fails leaves the others' figures. Run from the repository root on a machine with one CUDA device:
#
#     OUT=/tmp/gpu bash tools/gpu_session.sh
#
# A machine without this project's dependencies gets them from wheels in .whl/ (pip download ... -d .whl); the
# package itself runs from src/. Writes under $OUT: all.log (everything printed), gpu.json (benchmarks/gpu.py:
# memory against the plan, NCCL timings, offload, top kernels, against the plain loop, what the peak holds),
# throughput_gpu.json, throughput_gpu_read_at_once.json (--late-stats off) and throughput_gpu_compiled.json
# (benchmarks/throughput.py: tokens/s and MFU against a plain PyTorch loop), host_adam_vs_deepspeed_t16.json
# (benchmarks/host_adam_vs_deepspeed.py, with DeepSpeed from .whl/). Copied
# into benchmarks/results/, `python benchmarks/tables.py` renders them into docs/gpu.md ("On a GPU").
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
exec > >(tee "$OUT/all.log") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
part() {  # part SECONDS TITLE COMMAND...
    local limit=$1 title=$2; shift 2
    echo "=== $title (limit ${limit}s) $(date +%T)"
    local began=$SECONDS
    timeout -k 10 "$limit" "$@"
    echo "=== $title: exit $? after $((SECONDS - began))s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"

part 110 "GPU tests" python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --timeout 100 tests/system/test_gpu.py
part 60 "throughput, eager" python3 benchmarks/throughput.py --configs gpt2-124m/bf16 --batch-size 16 --rounds 7 \
    --out "$OUT/throughput_gpu.json"
part 60 "throughput, eager, statistics read at once" python3 benchmarks/throughput.py --configs gpt2-124m/bf16 \
    --batch-size 16 --rounds 7 --late-stats off --out "$OUT/throughput_gpu_read_at_once.json"
part 170 "benchmarks/gpu.py" python3 benchmarks/gpu.py --out "$OUT/gpu.json"
part 120 "throughput, compiled" python3 benchmarks/throughput.py --configs gpt2-124m/bf16 --batch-size 16 \
    --rounds 7 --compile --out "$OUT/throughput_gpu_compiled.json"
part 40 "offload's copies and the host's Adam, one by one" python3 benchmarks/offload_copies_gpu.py
# DeepSpeed from .whl (its CPU Adam compiles here on first use): the host's Adam against ZeRO-Offload's, 16 threads.
part 200 "the host's Adam against DeepSpeed's" env OMP_NUM_THREADS=16 python3 benchmarks/host_adam_vs_deepspeed.py \
    --threads 16 --out "$OUT/host_adam_vs_deepspeed_t16.json"
part 40 "minitrain train on the GPU, as a user runs it" python3 -m minitrain train --preset small --zero 2 \
    --precision bf16 --steps 30 --train.log_every 10 --memory-profile --out /tmp/cli-run
echo "=== done $(date +%T)"

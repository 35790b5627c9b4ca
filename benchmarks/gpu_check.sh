#!/bin/bash
# One GPU host's checks, each step bounded in time, in order of what matters most: the compiled
# codec kernels against the reference (tests/test_codec_kernels.py, Mosaic GPU and Triton), the
# codec throughput against a copy (both kernels), then benchmarks/accelerator.py's training rows
# for sdl_35m and sdl_1b (dp and Streaming DiLoCo e3m0, bfloat16, cuDNN attention, sequences of
# 2048).
#
#   bash benchmarks/gpu_check.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR: wheels of the dependencies the host's Python lacks, installed without resolving (the
# host's own jax, flax, optax, ... are used as they are). Every step writes its files into OUT_DIR
# as it ends, so a step that runs out of time leaves the earlier ones; a short table ends the
# output.
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR [WHEEL_DIR]}
wheels=${2:-}
mkdir -p "$out"
cd "$(dirname "$0")/.."
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_DISABLE_MOST_OPTIMIZATIONS=0
log=$out/gpu_check.log

step() {  # step SECONDS NAME COMMAND...: runs COMMAND with a time limit, its output into the log
  local seconds=$1 name=$2
  shift 2
  local start=$SECONDS
  echo "== $name (at most ${seconds}s): $*" | tee -a "$log"
  timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee -a "$log" | grep -v "^W\|^I[0-9]" | tail -25
  echo "== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$log"
}

step 30 environment python3 -c "
import jax, jaxlib
from lowcomm_jax.codecs import kernels
d = jax.devices()[0]
print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, d.device_kind,
      'compute capability', getattr(d, 'compute_capability', None))
print('gpu kernel picked:', kernels.gpu_kernel(),
      {k: kernels.gpu_kernel_refusal(k) for k in kernels.GPU_KERNELS})"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
  >>"$log" 2>&1

# The reference runs on the host's CPU, the kernels on the GPU.
step 110 kernel_tests env JAX_PLATFORMS=cuda,cpu python3 -m pytest tests/test_codec_kernels.py \
  -k compiled_gpu -p no:randomly -p no:cacheprovider -q -rs --junitxml="$out/kernel_tests.xml"

step 60 kernel_throughput python3 benchmarks/accelerator.py --parts=kernels \
  --gpu_kernels=mosaic_gpu,triton --log2_values=28 --repeats=5 --calls=10 \
  --out="$out/accelerator_kernels.json"

for model in 100:sdl_35m=16 200:sdl_1b=8; do
  seconds=${model%%:*} model=${model#*:}
  step "$seconds" "training_${model%=*}" python3 benchmarks/accelerator.py --parts=training \
    --models="${model%=*}" --batches="$model" --attention=dot_product --seq_len=2048 --steps=5 \
    --rounds=2 --warmup=1 --out="$out/accelerator_${model%=*}.json"
done

python3 - "$out" <<'EOF'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
print("\n==== summary")
tests = out / "kernel_tests.xml"
if tests.exists():
  text = tests.read_text()
  for case in re.findall(r'<testcase [^>]*name="([^"]+)"[^>]*?(/>|>.*?</testcase>)', text, re.S):
    verdict = "failed" if "<failure" in case[1] else "skipped" if "<skipped" in case[1] else "passed"
    print(f"kernel test {case[0]}: {verdict}")
for path in sorted(out.glob("accelerator_*.json")):
  result = json.loads(path.read_text())
  for row in result["kernels"]:
    figures = (f"{row['gb_per_s']:8.1f} GB/s {row['fraction_of_copy']:.3f} of copy"
               if "gb_per_s" in row else row["error"][:80])
    print(f"kernel {row['codec']:<5} {row.get('kernel', ''):<18} {figures}")
  for row in result["training"]:
    print(f"train {row['model']:<8} {row['algorithm']:<22} batch {row['batch_per_device']:>3} "
          f"{row['tokens_per_s']:>10.0f} tok/s  MFU {row['mfu']:.3f}  step/dp "
          f"{row['step_over_dp']:.3f}  {row['codec_kernel']}")
EOF

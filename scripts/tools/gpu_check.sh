#!/usr/bin/env bash
# hetjax's GPU check in one command (about 4 minutes on one H100/H200):
#     bash scripts/tools/gpu_check.sh [--smoke] [OUTDIR]   (default: $OUT, else runs/gpu_check)
# 1. `hetjax calibrate --quick` on the device, for a TinyLlama-1.1B-shaped job (bf16 compute,
#    fp32 parameters, batch 8 x 2048, no recompute) on `topology.preset=local`;
#    it also writes the measurements as a compute profile (the layer and head at one sequence
#    and at the job's micro-batch);
# 2. `hetjax plan` of that job priced with the calibration, compute flat and by operation kind,
#    and from the profile (predicted step time +- its band and memory per device);
# 3. scripts/bench/gpu.py: hetjax's Trainer, a hand-written jax.jit step with the fused kernel,
#    and HuggingFace's Llama eager and torch.compile of the same shape, with the prediction.
# Wheels the image lacks (ml_collections, grain, tfds, ...) are installed from .whl/ when present
# (scripts/tools/gpu_wheels.sh downloads them). --smoke (or GPU_CHECK_SMOKE=1) runs a tiny shape
# (on CPU too).
set -u
case "${1:-}" in
  -h|--help) echo "usage: bash scripts/tools/gpu_check.sh [--smoke] [OUTDIR]"
             sed -n '2,/^set -u/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
  --smoke) GPU_CHECK_SMOKE=1; shift ;;
esac
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$out"
py=${PYTHON:-python3}
if ! "$py" -c "import ml_collections, grain, tensorflow_datasets" 2>/dev/null &&
   ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hetjax-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/hetjax-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then
  batch=2
  quick=(--min_sample=0 --repeats=1)  # one call a measurement: the smoke checks the path
  cal_s=600  # compiles dominate on a shared CPU
  job=(--config.model.d_model=64 --config.model.n_layers=2 --config.model.n_heads=4
       --config.model.n_kv_heads=2 --config.model.d_ff=128 --config.model.vocab_size=512
       --config.model.max_seq_len=64 --config.train.batch_size=2 --config.train.seq_len=64)
  bench=(--smoke --steps 1 --warmup 1 --rows trainer,jit-fused)
else
  batch=8
  quick=()
  cal_s=180
  job=(--config.model.preset=tinyllama_1b --config.train.batch_size=8
       --config.train.seq_len=2048)
  bench=(--steps 5 --warmup 2 --row-timeout 75 --rows trainer,jit-fused,hf-eager,hf-compile)
fi
job+=(--config.topology.preset=local --config.model.dtype=bfloat16
      --config.model.param_dtype=float32 --config.model.remat=none --config.model.tie_embeddings=False
      --config.parallel.pp=1 --config.parallel.dp=1 --config.parallel.tp=1 --config.train.microbatches=1
      --config.data.source=synthetic --config.workdir="$out/run")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
"$py" -c "import jax; print('jax', jax.__version__, jax.devices())"
echo "== 1. hetjax calibrate --quick (and the compute profile: micro-batches of 1 and of the job)"
timeout $cal_s "$py" -m hetjax calibrate --quick "${quick[@]}" "${job[@]}" --batches="1,$batch" \
  --out="$out/calibration.json" --profile="$out/profile.json" \
  > "$out/calibrate.log" 2>&1; echo "exit $?"; tail -n 25 "$out/calibrate.log"
cal=()
[ -f "$out/calibration.json" ] && cal=(--config.planner.calibration="$out/calibration.json")
for compute in flat kinds; do
  echo "== 2. hetjax plan (compute $compute)"
  timeout 40 "$py" -m hetjax plan "${job[@]}" "${cal[@]}" --config.planner.compute=$compute \
    --json="$out/plan_$compute.json" > "$out/plan_$compute.log" 2>&1; echo "exit $?"
  grep -iE "predicted|step|memory|fit|MFU|warning" "$out/plan_$compute.log" | head -n 12
done
# the same job priced from the profile alone (no calibration file: the flat model's links)
echo "== 2. hetjax plan (compute profile)"
prof=()
[ -f "$out/profile.json" ] && prof=(--config.planner.profile="$out/profile.json")
timeout 40 "$py" -m hetjax plan "${job[@]}" "${prof[@]}" --json="$out/plan_profile.json" \
  > "$out/plan_profile.log" 2>&1; echo "exit $?"
grep -iE "predicted|step|memory|fit|MFU|warning|profile" "$out/plan_profile.log" | head -n 12
echo "== 3. scripts/bench/gpu.py"
calflag=()
[ -f "$out/calibration.json" ] && calflag=(--calibration "$out/calibration.json")
timeout 330 "$py" scripts/bench/gpu.py --out "$out/bench_gpu.json" "${bench[@]}" "${calflag[@]}"
echo "exit $?"

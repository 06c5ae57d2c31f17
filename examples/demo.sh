#!/usr/bin/env bash
# The whole npukit journey on the bundled CUDA project (examples/cuda_project):
# migrate -> train on the emulated NPU (fp16 autocast) -> golden vs NPU dumps -> npu-compare
# -> overflow detection -> profile with advice. Reports land in demo-out/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=demo-out
rm -rf "$OUT"
mkdir -p "$OUT"
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "1. npu-migrate: rewrite the CUDA project into torch_npu code (into a copy)"
npu-migrate examples/cuda_project --out "$OUT/migrated" --report "$OUT/migrate-report"
APP="$OUT/migrated"

say "2. npu-run: the migrated tiny GPT trains on the emulated NPU with fp16 autocast"
npu-run "$APP/train_gpt.py" --steps 30 --amp

say "3. golden run and NPU run of the same command, per-layer dumps of step 0"
# --golden keeps the script and its arguments (GradScaler included) but turns autocast and the
# NPU numerics off, so the two runs differ only by what the NPU changes.
npu-run --golden --seed 0 --replay "$OUT/replay" --dump "$OUT/dump-golden" --dump-mode tensor --dump-steps 0 \
    "$APP/train_gpt.py" --steps 1 --amp
npu-run --seed 0 --replay "$OUT/replay" --dump "$OUT/dump-npu" --dump-mode tensor --dump-steps 0 \
    "$APP/train_gpt.py" --steps 1 --amp

say "4. npu-compare: per-layer drift between the golden and the NPU run"
compare_status=0
npu-compare "$OUT/dump-golden" "$OUT/dump-npu" --top 8 --csv "$OUT/compare.csv" --json "$OUT/compare.json" \
    --html "$OUT/compare.html" || compare_status=$?
if [ "$compare_status" -gt 1 ]; then exit "$compare_status"; fi

say "5. overflow detection during fp16 training (saturation mode, like Ascend 910A)"
NPUKIT_FP16_MODE=saturation npu-run --detect-overflow --overflow-dir "$OUT/overflow" \
    "$APP/train_gpt.py" --steps 10 --amp

say "6. npu-profile: op hotspots, estimated 910B2 time and advice"
npu-run --profile "$OUT/profile" --profile-steps 1,1,3 "$APP/train_gpt.py" --steps 6 --amp
npu-profile "$OUT/profile" --chip 910B2 --top 12 --advise

say "Reports"
cat <<REPORTS
  migration report     $OUT/migrate-report/report.md  (+ report.json, change_list.csv, report.sarif)
  migrated project     $OUT/migrated/
  accuracy compare     $OUT/compare.html  (+ compare.csv, compare.json)
  overflow events      $OUT/overflow/
  profile              $OUT/profile/  (Perfetto / TensorBoard trace: $OUT/profile/rank0.*.pt.trace.json)
REPORTS

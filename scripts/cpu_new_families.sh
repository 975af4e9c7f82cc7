#!/usr/bin/env bash
# The CPU rows of docs/benchmarks.md for the families added since the family table: one block per block list at the
# model's real width, a real token count, one at a time on an otherwise idle machine.
# `bash scripts/cpu_new_families.sh [ARCH ...]` (default: every arch below); JSON and logs in $OUT (default
# /tmp/cpu-new-families).
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/cpu-new-families}; mkdir -p "$out"
log="$out/bench.log"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$log"
common=(--layers 1 --batch 1 --dtype float32 --threads 2 --rounds 2 --presets balanced fast
        --no-tomesd --no-trained-quality --no-memory --no-host-cost --no-progress)
image=(--resolution 1024)
video=(--resolution 480 --width 832 --frames 33)
declare -A size=(
  [krea2]=image [flux3]=image [longcat_image]=image [qwenimage21]=image [ernie_image]=image
  [hunyuanimage]=image [hidream]=image [kandinsky5-image]=image
  [kandinsky5]=video [kandinsky6]=video [wan-animate]=video [chronoedit]=video [helios]=video
)
archs=("$@")
[ ${#archs[@]} -eq 0 ] && archs=("${!size[@]}")
for arch in "${archs[@]}"; do
  kind=${size[$arch]:-image}
  if [ "$kind" = video ]; then args=("${video[@]}"); else args=("${image[@]}"); fi
  echo "### $arch: tome-processors bench --arch $arch ${common[*]} ${args[*]}" | tee -a "$log"
  uptime | tee -a "$log"
  python -m tome_processors bench --arch "$arch" "${common[@]}" "${args[@]}" --json "$out/$arch.json" 2>&1 \
    | grep -v -e Warning -e torchao -e W1206 -e "^Unable" | tee -a "$log"
done

#!/usr/bin/env bash
# The CPU rows of docs/benchmarks.md for the families added with the family table: one block per block list at the
# model's real width and a real token count (images at 1024 px; video at 480x832 px and 33 frames, or the clip the
# family's pipeline makes by default where that is smaller), batch 1, float32, two threads, the baseline and
# `balanced` in paired rounds, one architecture at a time on an otherwise idle machine.
# `bash scripts/cpu_new_families.sh [ARCH ...]` (default: the list below); JSON and a log in $OUT (default
# /tmp/cpu-new-families).
set -u
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/cpu-new-families}; mkdir -p "$out"
log="$out/bench.log"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$log"
common=(--layers 1 --batch 1 --dtype float32 --threads 2 --presets balanced
        --no-tomesd --no-trained-quality --no-memory --no-host-cost --no-progress)
image=(--resolution 1024 --rounds 3)
video=(--resolution 480 --width 832 --frames 33 --rounds 3)
declare -A size=(
  [krea2]=image [flux3]=image [longcat_image]=image [qwenimage21]=image [ernie_image]=image [hunyuanimage]=hy2048
  [hidream]=image [kandinsky5-image]=image [sana]=image [lumina2]=image
  [kandinsky5]=video [kandinsky6]=video [wan-animate]=video [cogvideox]=video [cosmos]=video [mochi]=mochi
  [chronoedit]=own [helios]=own
)
order=(lumina2 cogvideox cosmos mochi sana kandinsky5-image ernie_image qwenimage21 hidream longcat_image flux3 hunyuanimage krea2
       kandinsky5 chronoedit helios kandinsky6 wan-animate)
archs=("$@")
[ ${#archs[@]} -eq 0 ] && archs=("${order[@]}")
for arch in "${archs[@]}"; do
  case ${size[$arch]:-image} in
    video) args=("${video[@]}") ;;
    own) args=(--rounds 3) ;;  # the clip its pipeline makes by default (bench.archs)
    mochi) args=(--resolution 480 --width 832 --frames 37 --rounds 3) ;;  # its VAE takes 6k + 1 frames: 7 latent
    hy2048) args=(--resolution 2048 --rounds 3) ;;  # HunyuanImage 2.1's native size (its VAE is 32x: 4,096 tokens)
    *) args=("${image[@]}") ;;
  esac
  echo "### $arch: tome-processors bench --arch $arch ${common[*]} ${args[*]}" | tee -a "$log"
  uptime | tee -a "$log"
  python -m tome_processors bench --arch "$arch" "${common[@]}" "${args[@]}" --json "$out/$arch.json" 2>&1 \
    | grep -v -e Warning -e torchao -e W1206 -e "^Unable" -e "kept in float32" | tee -a "$log"
done

#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md, in one device call: `bash scripts/gpu_figures.sh PART`.
# Expects diffusers and tomesd wheels in .whl/ (README of the device tool) and writes to $OUT.
# Video runs skip the trained-model columns: they run on the host CPU and would eat the time limits.
set -u
export PYTHONUNBUFFERED=1
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
export PYTHONPATH="$site:src"
out=${OUT:-/tmp/gpu-figures}; mkdir -p "$out/json"
log="$out/bench-$1.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$log"
bench() {  # bench SECONDS NAME ARGS...: single forwards also write each method's top ops (`--profile`)
  local limit=$1 name=$2; shift 2
  local profile=(--profile "$out/json/$name-profile.md")
  [[ " $* " == *" --pipeline "* ]] && profile=()
  echo "### $name: tome-processors bench --device cuda $*" | tee -a "$log"
  timeout -k 5 "$limit" python3 -m tome_processors bench --device cuda --no-progress --json "$out/json/$name.json" \
    "${profile[@]}" "$@" 2>&1 | grep -v Warning | tee -a "$log"
}
case $1 in
  final)  # the presets' rule (pays_only) where presets were level or slower and at high resolution; bit-identical
    # merges; a LoRA training step at 768 px; the hires-fix workflow per image. No --profile (device time).
    timeout 45 python3 scripts/gpu_determinism.py --device cuda 2>&1 | grep -v Warning | tee -a "$log"
    plain() { local limit=$1 name=$2; shift 2; echo "### $name: tome-processors bench --device cuda $*" | tee -a "$log"
      timeout -k 5 "$limit" python3 -m tome_processors bench --device cuda --no-progress --json "$out/json/$name.json" \
        "$@" 2>&1 | grep -v Warning | tee -a "$log"; }
    q=(--no-tomesd --no-trained-quality)
    plain 30 sd15-512 --arch sd15 --resolution 512 --batch 2 --rounds 5 "${q[@]}"
    plain 45 sdxl-1024 --arch sdxl --resolution 1024 --batch 2 --rounds 3 "${q[@]}"
    plain 40 pixart-1024 --arch pixart --resolution 1024 --batch 2 --rounds 3 "${q[@]}"
    plain 45 qwenimage-1024-4 --arch qwenimage --resolution 1024 --layers 4 --batch 2 --dtype bfloat16 --rounds 3 "${q[@]}"
    plain 30 sd15-1024 --arch sd15 --resolution 1024 --batch 2 --rounds 3 "${q[@]}"
    plain 30 sd15-2048 --arch sd15 --resolution 2048 --batch 1 --rounds 2 "${q[@]}"
    plain 60 sdxl-2048 --arch sdxl --resolution 2048 --batch 1 --rounds 2 "${q[@]}"
    plain 90 train-768 --train --dtype bfloat16 --arch sd15 --resolution 768 --batch 2 --presets balanced fast \
      --rounds 3 --gradient-checkpointing --no-host-cost "${q[@]}"
    plain 110 hires --pipeline --hires --steps 20 --strength 0.5 --presets balanced fast --rounds 2 --no-memory "${q[@]}"
    ;;
  bounds)  # how far attention-only methods can go (each profile's attention line) at high resolution and in a LoRA
    # step, beside the presets; the rows where no preset merges, with more rounds (never slower)
    q=(--no-tomesd --no-trained-quality)
    bench 60 sd15-1024 --arch sd15 --resolution 1024 --batch 2 --rounds 3 --modes kv4-avg-2lv "${q[@]}"
    bench 60 sd15-2048 --arch sd15 --resolution 2048 --batch 1 --rounds 2 --modes kv4-avg-2lv "${q[@]}"
    bench 80 sdxl-2048 --arch sdxl --resolution 2048 --batch 1 --rounds 2 --modes kv-avg-2lv kv4-avg-2lv "${q[@]}"
    bench 80 train-768 --train --dtype bfloat16 --arch sd15 --resolution 768 --batch 2 --presets balanced fast \
      --modes kv4-avg-2lv --rounds 3 --no-host-cost "${q[@]}"
    for spec in "sd15-512 --arch sd15 --resolution 512 --rounds 10" "sdxl-1024 --arch sdxl --resolution 1024 --rounds 5" \
      "pixart-1024 --arch pixart --resolution 1024 --rounds 5" \
      "qwenimage-1024-4 --arch qwenimage --resolution 1024 --layers 4 --dtype bfloat16 --rounds 5"; do
      read -r name args <<<"$spec"
      # shellcheck disable=SC2086
      bench 50 "$name" $args --batch 2 "${q[@]}"
    done
    ;;
  trainsizes)  # the LoRA step where the GPU is busier: batch 8 at 768 px, batch 2 at 1024 px (profiles too)
    q=(--no-tomesd --no-trained-quality --no-host-cost)
    bench 130 train-768-b8 --train --dtype bfloat16 --arch sd15 --resolution 768 --batch 8 --presets balanced fast \
      --rounds 3 "${q[@]}"
    bench 100 train-1024 --train --dtype bfloat16 --arch sd15 --resolution 1024 --batch 2 --presets balanced fast \
      --rounds 3 "${q[@]}"
    ;;
  hires)  # Stable Diffusion at high resolution: SD1.5 at 1024 (a CFG batch) and 2048, SDXL at 2048, presets and the
    # K/V pooling modes, the trained-model columns left out (they run on the host CPU)
    bench 75 sd15-1024 --arch sd15 --resolution 1024 --batch 2 --rounds 3 --no-tomesd --no-trained-quality \
      --modes kv-avg kv4-avg kv4-avg-2lv share window-share
    bench 90 sd15-2048 --arch sd15 --resolution 2048 --batch 1 --rounds 2 --no-tomesd --no-trained-quality \
      --modes kv-avg kv4-avg kv4-avg-2lv share
    bench 110 sdxl-2048 --arch sdxl --resolution 2048 --batch 1 --rounds 2 --no-tomesd --no-trained-quality \
      --modes kv-avg kv4-avg kv4-avg-2lv share
    ;;
  determinism)  # whether merged forwards are bit-identical run after run on the GPU
    timeout 60 python3 scripts/gpu_determinism.py --device cuda 2>&1 | grep -v Warning | tee -a "$log"
    ;;
  video)
    bench 230 wan81 --arch wan --resolution 480 --width 832 --frames 81 --batch 1 --dtype bfloat16 --rounds 3 --modes temporal-only --no-trained-quality
    for arch in qwenimage chroma zimage flux; do
      bench 65 "$arch-1024" --arch "$arch" --resolution 1024 --layers 4 --dtype bfloat16 --rounds 5
    done
    bench 70 flux2-1024 --arch flux2 --resolution 1024 --layers 2 --dtype bfloat16 --rounds 5
    ;;
  newimages)  # the newer image transformers per forward at 1024 px with the current presets (window matching), the
    # trained-model columns left out (they run on the host CPU)
    for arch in qwenimage chroma zimage; do
      bench 55 "$arch-1024-presets" --arch "$arch" --resolution 1024 --layers 4 --dtype bfloat16 --rounds 5 --no-tomesd \
        --no-trained-quality
    done
    bench 60 flux2-1024-presets --arch flux2 --resolution 1024 --layers 2 --dtype bfloat16 --rounds 5 --no-tomesd \
      --no-trained-quality
    ;;
  profiles)  # where the merged forwards' time goes (each run writes its top ops, `--profile`): Qwen-Image at its full
    # depth and batch 2 (its batch in one attention call since 8eb9395; `fast` barely beat `balanced` per image at
    # d4b8084), LTX-2 (1.10x at 4 blocks although its video self-attention merges 75% of the tokens)
    bench 150 qwenimage-1024-full --arch qwenimage --resolution 1024 --dtype bfloat16 --rounds 3 --no-tomesd \
      --no-trained-quality
    bench 120 ltx2-121-profile --arch ltx2 --layers 4 --batch 1 --dtype bfloat16 --rounds 3 --no-trained-quality
    ;;
  images)
    bench 110 sd15-512 --arch sd15 --resolution 512 --rounds 10
    bench 110 sdxl-1024 --arch sdxl --resolution 1024 --rounds 5
    bench 90 pixart-1024 --arch pixart --resolution 1024 --rounds 5
    bench 90 sd3-1024 --arch sd3 --resolution 1024 --rounds 5
    bench 120 flux-pipe-fbc --pipeline --arch flux --layers 4 --text-encoders small --resolution 1024 --steps 8 --rounds 1 --cache fbc --presets balanced --dtype bfloat16
    ;;
  compiled)
    bench 300 wan81-compiled --arch wan --resolution 480 --width 832 --frames 81 --batch 1 --dtype bfloat16 --layers 6 --compile --rounds 3 --presets balanced fast --no-trained-quality
    bench 230 sd15-512-compiled --arch sd15 --resolution 512 --compile reduce-overhead --rounds 5 --no-tomesd
    ;;
  ltx)
    bench 200 ltx-121 --arch ltx --resolution 512 --width 768 --frames 121 --batch 1 --dtype bfloat16 --rounds 3 --no-trained-quality
    bench 250 ltx-704x1216 --arch ltx --resolution 704 --width 1216 --frames 121 --batch 1 --dtype bfloat16 --rounds 3 --no-trained-quality
    ;;
  window)  # the window-matching presets (video balanced/fast, joint transformers balanced/fast) against exact, and
    # the feed-forward merged too (mlp-share) on the joint transformers, where it might be the faster `fast`
    bench 230 wan81-window --arch wan --resolution 480 --width 832 --frames 81 --batch 1 --dtype bfloat16 --rounds 3 --no-trained-quality
    for arch in qwenimage flux; do
      bench 70 "$arch-1024-window" --arch "$arch" --resolution 1024 --layers 4 --dtype bfloat16 --rounds 5 --ratios 0.5 \
        --modes mlp-share --no-tomesd
    done
    ;;
  imagepipes)  # whole 1024 px images of the newer image transformers at full depth, bf16: `imagepipes [ARCH...]`
    # (all four by default; their limits add up to 11 minutes: name two per call where a call may take 10).
    # FLUX.2-dev's 64 GB transformer leaves no room on an 80 GB GPU for Mistral-Small's 48 GB: its text encoder is
    # 2 layers deep. Z-Image runs Z-Image-Turbo's published call: 8 steps, no classifier-free guidance.
    archs=("${@:2}")
    [ ${#archs[@]} -gt 0 ] || archs=(qwenimage flux2 chroma zimage)
    for arch in "${archs[@]}"; do
      case $arch in
        qwenimage) bench 200 qwenimage-pipe --pipeline --arch qwenimage --resolution 1024 --dtype bfloat16 --steps 10 \
                     --rounds 1 --presets balanced fast ;;
        flux2) bench 200 flux2-pipe --pipeline --arch flux2 --text-encoders small --resolution 1024 --dtype bfloat16 \
                 --steps 10 --rounds 1 --presets balanced fast ;;
        chroma) bench 150 chroma-pipe --pipeline --arch chroma --resolution 1024 --dtype bfloat16 --steps 10 --rounds 2 \
                  --presets balanced fast ;;
        zimage) bench 120 zimage-pipe --pipeline --arch zimage --resolution 1024 --dtype bfloat16 --steps 8 \
                  --guidance-scale 0 --rounds 2 --presets balanced fast ;;
        *) echo "unknown arch $arch" | tee -a "$log" ;;
      esac
    done
    ;;
  newvideo)  # HunyuanVideo 1.5 (its default 480p clip, 121 frames: 49,290 tokens) and Wan2.1 image-to-video 14B
    # (81 frames, 32,760 tokens + 769 of text and image), 4 blocks of each at the real width
    bench 200 hv15-121 --arch hunyuanvideo15 --layers 4 --batch 1 --dtype bfloat16 --rounds 3 --no-trained-quality
    bench 200 wan-i2v-81 --arch wan-i2v --layers 4 --batch 1 --dtype bfloat16 --rounds 3 --no-trained-quality
    ;;
  jointvideo)  # HunyuanVideo (544x960, 33 frames) and LTX-2 (512x768, 121 frames: its video tokens), 4 blocks each
    bench 200 hunyuanvideo-33 --arch hunyuanvideo --layers 4 --batch 1 --dtype bfloat16 --rounds 3 --no-trained-quality
    bench 200 ltx2-121 --arch ltx2 --layers 4 --batch 1 --dtype bfloat16 --rounds 3 --no-trained-quality
    ;;
  cache)  # a step cache that acts on random weights (TaylorSeer lite: a fixed schedule) alone and with ToMe, per image
    bench 300 qwenimage-pipe-taylorseer --pipeline --arch qwenimage --layers 8 --text-encoders small --resolution 1024 \
      --dtype bfloat16 --steps 8 --rounds 2 --cache taylorseer-lite --presets balanced fast
    ;;
  wan720)
    bench 330 wan720-81 --arch wan --resolution 720 --width 1280 --frames 81 --batch 1 --dtype bfloat16 --rounds 2 --no-trained-quality
    ;;
  parallel)  # the one-GPU inputs of docs/several-gpus.md's model of Wan on 2-8 GPUs: 480p and 720p, the presets
    q=(--no-tomesd --no-trained-quality --presets balanced fast)
    bench 150 wan480-81 --arch wan --resolution 480 --width 832 --frames 81 --batch 1 --dtype bfloat16 --rounds 3 "${q[@]}"
    bench 300 wan720-81 --arch wan --resolution 720 --width 1280 --frames 81 --batch 1 --dtype bfloat16 --rounds 2 "${q[@]}"
    ;;
  parallel14b)  # Wan 14B's width (40 heads: Ulysses over 2, 4 or 8 GPUs) at 720p: 4 and 8 of its 40 blocks, so the
    # whole forward is the blocks' slope times 40 plus what lies outside the blocks
    q=(--no-tomesd --no-trained-quality --no-memory --no-host-cost --presets balanced fast)
    for layers in 4 8; do
      bench 200 "wan14b720-81-l$layers" --arch wan-i2v --resolution 720 --width 1280 --frames 81 --batch 1 \
        --dtype bfloat16 --layers "$layers" --rounds 2 "${q[@]}"
    done
    ;;
esac
tar -C "$out" -czf "$out/json-$1.tgz" json && rm -r "$out/json"

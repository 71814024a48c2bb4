#!/usr/bin/env bash
# The GPU check for a session whose `device` tool lends a machine (see docs/benchmarks.md): the embedded
# trained model built and run with --device cuda, compared with the CPU image of the same bundle settings and
# meaning-checked (training/shapes.py); then
# the real-width benchmark at depth 8 in bf16 on the GPU against diffusers.
# Run from the repo root on the GPU machine; prints figures and writes them to ${OUT:-/tmp}/cuda-check.txt.
# Never run in CI (no GPU there); untested until a session gets a GPU.
set -euo pipefail
out=${OUT:-/tmp}
python3 -m venv /tmp/qic-venv && /tmp/qic-venv/bin/pip install -q -c constraints-ci.txt -e '.[dev]'
q=/tmp/qic-venv/bin/qic
prompt="a yellow circle on a blue background"
common=(--prompt "$prompt" --seed 3)
$q build --device cuda --resolution 128x128 --output /tmp/cuda-bundle --cache-dir /tmp/cuda-cache
$q run /tmp/cuda-bundle "${common[@]}" --output "$out/cuda.png" --verbose
$q build --device cpu --resolution 128x128 --output /tmp/cpu-bundle --cache-dir /tmp/cpu-cache
$q run /tmp/cpu-bundle "${common[@]}" --output "$out/cpu.png" --verbose
PYTHONPATH=. /tmp/qic-venv/bin/python - "$out" "$prompt" <<'PY' | tee "$out/cuda-check.txt"
import sys, numpy as np
from PIL import Image
from training import shapes
a, b = (np.asarray(Image.open(f"{sys.argv[1]}/{n}.png").convert("RGB")) for n in ("cuda", "cpu"))
d = np.abs(a.astype(float) - b)
print(f"cuda vs cpu image: max {d.max():.0f}/255, mean {d.mean() / 255:.5f} (expect max <= 2/255)")
print(f"cuda image reads {shapes.read_image(a)}; the prompt says {shapes.parse_prompt(sys.argv[2])}")
PY
# Real width, depth 8, bf16 (VAE fp32): qic's step time against diffusers eager on the same GPU, for
# docs/benchmarks.md (plots into $out, not over the CPU plots in docs/img).
/tmp/qic-venv/bin/python -m benchmarks.realwidth --device cuda --dtype bfloat16 --depth 8 --resolutions 1024 \
  --steps 4 --dir /tmp/realwidth-gpu --img "$out" | tee "$out/realwidth-gpu.txt"

#!/usr/bin/env bash
# The GPU check for a session whose `device` tool lends a machine (see docs/benchmarks.md): the embedded
# model built and run with --device cuda, compared with the CPU image of the same bundle settings; then
# the real-width benchmark at depth 8 in bf16 on the GPU against diffusers.
# Run from the repo root on the GPU machine; prints figures and writes them to ${OUT:-/tmp}/cuda-check.txt.
# Never run in CI (no GPU there); untested until a session gets a GPU.
set -euo pipefail
out=${OUT:-/tmp}
python3 -m venv /tmp/qic-venv && /tmp/qic-venv/bin/pip install -q -c constraints-ci.txt -e '.[dev]'
q=/tmp/qic-venv/bin/qic
common=(--prompt "a red bicycle" --steps 8 --seed 3)
$q build --device cuda --output /tmp/cuda-bundle --cache-dir /tmp/cuda-cache
$q run /tmp/cuda-bundle "${common[@]}" --output "$out/cuda.png" --verbose
$q build --device cpu --output /tmp/cpu-bundle --cache-dir /tmp/cpu-cache
$q run /tmp/cpu-bundle "${common[@]}" --output "$out/cpu.png" --verbose
/tmp/qic-venv/bin/python - "$out" <<'PY' | tee "$out/cuda-check.txt"
import sys, numpy as np
from PIL import Image
a, b = (np.asarray(Image.open(f"{sys.argv[1]}/{n}.png")).astype(float) for n in ("cuda", "cpu"))
d = np.abs(a - b)
print(f"cuda vs cpu image: max {d.max():.0f}/255, mean {d.mean() / 255:.5f} (expect max <= 2/255)")
PY
# Real width, depth 8, bf16 (VAE fp32): qic's step time against diffusers eager on the same GPU, for
# docs/benchmarks.md (plots into $out, not over the CPU plots in docs/img).
/tmp/qic-venv/bin/python -m benchmarks.realwidth --device cuda --dtype bfloat16 --depth 8 --resolutions 1024 \
  --steps 4 --dir /tmp/realwidth-gpu --img "$out" | tee "$out/realwidth-gpu.txt"

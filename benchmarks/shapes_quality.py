"""Does the trained embedded model draw what it is told? Every prompt of the grammar, through a qic bundle.

    python -m benchmarks.shapes_quality [--seeds 4] [--steps 20] [--guidance 4] [--dir DIR] [--cache-dir DIR]
    python -m benchmarks.shapes_quality --smoke    # 2 held-out and 2 training triples, 1 seed, 128x128, 2 steps

Builds the default bundle (`qic build`: embedded:shapes at 128x128, 96x160 and 160x96) into DIR, then draws
each of the 168 (colour, shape, background) triples with each seed, the seeds spread over the three
resolutions, and reads every image back with training/shapes.py's meaning check. Prints, for the held-out
and the training triples, the fraction right in all three attributes and in each one, per resolution, and
writes a grid of the held-out triples (seed 0) to docs/img/shapes-held-out.png.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import parse_args
from qic.checkpoint import trained
from training import shapes

RESOLUTIONS = trained.resolutions("shapes")   # the three the default bundle holds
GRID = Path(__file__).resolve().parents[1] / "docs" / "img" / "shapes-held-out.png"


def draw(bundle: Path, jobs, steps: int, guidance: float) -> list[np.ndarray]:
    from qic.runtime.bundle import Bundle
    from qic.runtime.generate import Request, generate
    b = Bundle(bundle)
    return [np.asarray(generate(b, Request(prompt=p, seed=s, steps=steps, guidance=guidance, height=h,
                                           width=w)).image) for p, s, (h, w) in jobs]


def grid(images, labels, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = 6
    rows = -(-len(images) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * 1.9, rows * 2.1))
    for ax in np.ravel(axes):
        ax.axis("off")
    for ax, img, label in zip(np.ravel(axes), images, labels):
        ax.imshow(img)
        ax.set_title(label, fontsize=6.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance", type=float, default=4.0)
    ap.add_argument("--dir", type=Path, default=Path("artifacts/bench-shapes"))
    ap.add_argument("--cache-dir", type=Path, help="qic's compile cache (default: DIR/cache)")
    # Drawing is the smoke's own cost (the 128x128 build is the session's default one): the scheduler's fewest steps.
    args = parse_args(ap, argv, {"steps": 2})
    bundle = args.dir / "bundle"
    build = [sys.executable, "-m", "qic.cli", "build", "--cache-dir", str(args.cache_dir or args.dir / "cache"),
             "--output", str(bundle)]
    res = RESOLUTIONS[:1] if args.smoke else RESOLUTIONS
    if args.smoke:
        build += ["--resolution", "128x128"]
    subprocess.run(build, check=True, capture_output=True)
    groups = {"held-out": shapes.HELD_OUT[:2] if args.smoke else shapes.HELD_OUT,
              "training": shapes.TRAIN[:2] if args.smoke else shapes.TRAIN}
    seeds = range(1 if args.smoke else args.seeds)
    print("| triples | resolution | images | all three right | colour | shape | background |")
    print("|---|---|---|---|---|---|---|")
    held_out_images = []
    for name, triples in groups.items():
        jobs = [(shapes.prompt_of(*t), s, res[(i + s) % len(res)]) for i, t in enumerate(triples) for s in seeds]
        t0 = time.perf_counter()
        images = draw(bundle, jobs, args.steps, args.guidance)
        seconds = time.perf_counter() - t0
        read = [shapes.read_image(img) for img in images]
        want = [shapes.parse_prompt(p) for p, _, _ in jobs]
        if name == "held-out":
            held_out_images = [(img, p) for img, (p, s, _) in zip(images, jobs) if s == 0]
        for r in [*res, None]:
            idx = [i for i, (_, _, hw) in enumerate(jobs) if r is None or hw == r]
            if not idx:
                continue
            frac = [np.mean([read[i][k] == want[i][k] for i in idx]) for k in range(3)]
            allr = np.mean([read[i] == want[i] for i in idx])
            label = "all" if r is None else f"{r[0]}x{r[1]}"
            print(f"| {name} | {label} | {len(idx)} | {allr:.3f} | {frac[0]:.3f} | {frac[1]:.3f} | {frac[2]:.3f} |")
        wrong = [(jobs[i][0], jobs[i][1], read[i]) for i in range(len(jobs)) if read[i] != want[i]]
        print(f"{name}: {len(jobs)} images in {seconds:.0f} s; wrong: {wrong}", file=sys.stderr)
    if not args.smoke:
        grid([img for img, _ in held_out_images],
             [p.replace("a ", "", 1).replace(" background", "") for _, p in held_out_images], GRID)
        print(f"wrote {GRID}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

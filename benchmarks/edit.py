"""An edit at real widths: qic's Edit Plus bundle against diffusers' QwenImageEditPlusPipeline on the same weights,
per stage, in one run.

    python -m benchmarks.edit [--depth 1] [--size 512] [--steps 2] [--runs 2]
    python -m benchmarks.edit --smoke     # the embedded tiny model's widths, 64x64, 2 steps, 1 run, built with the
                                          # export back end (nothing compiled: the suite compiles these kinds)

1. writes a random checkpoint in the real layout with the real Qwen-Image widths at `--depth` blocks
   (benchmarks.realwidth's recipe: 24 heads of 128, Qwen2.5-VL's 3584-wide language model and 1280-wide vision
   tower with its window and full-attention blocks, the real VAE) and makes it an Edit Plus checkpoint
   (model_index.json's class, a processor/ folder with Qwen2.5-VL's published image-processor settings);
2. `qic build` of it at one condition size and output size of `--size` square (fp32, one text bucket of 256, one
   image a request) with a fresh compile cache: how many graphs, and each one's compile seconds;
3. one edit of a `--size` square picture, `--steps` steps, true CFG 4, through the bundle (qic's edit program, in
   this process) and through the pipeline (the pipeline's VAE-side area set to `--size` squared, as
   tests/test_qwen_image_edit.py does, with qic asked for the nearest built size; the vision side is the
   pipeline's 384*384; the pipeline's text encoder given the 3-D positions its models were trained with, ibid.):
   the median of `--runs` per stage: vision tower, language model (both CFG branches), VAE encoder, denoise steps,
   decoder, and the two images' pixel difference;
4. the default Plus build's graph count (seven condition sizes and seven output presets) and its compile time
   estimated from this run's per-kind compile seconds.
Everything is written under --dir (artifacts/edit), never committed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from PIL import Image

from benchmarks import parse_args, smoke_dir
from benchmarks.realwidth import write_realwidth_checkpoint

REPO = Path(__file__).resolve().parents[1]
PROMPT, NEGATIVE, GUIDANCE, SEED, BUCKET = "make the bicycle red", " ", 4.0, 0, 256
# Qwen2.5-VL's published preprocessor_config.json (the Edit models' processor folder)
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711], "min_pixels": 3136, "max_pixels": 12845056}
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{%- endfor %}")
STAGES = ("vision", "language model", "vae_encoder", "steps", "decoder")


def edit_checkpoint(out: Path, depth: int, tiny: bool) -> Path:
    """A random Qwen-Image checkpoint (real widths, or the embedded tiny model's) turned into an Edit Plus one."""
    if not (out / "model_index.json").is_file():
        if tiny:
            from qic.checkpoint.embedded import write_checkpoint
            write_checkpoint(out, "tiny", seed=0)
        else:
            write_realwidth_checkpoint(out, depth)
    # The embedded tokenizer's special tokens sit at its own ids (below 1024): the language model's config names them
    from qic.checkpoint.presets import special_id
    te_config = json.loads((out / "text_encoder" / "config.json").read_text())
    te_config.update({key: special_id(token) for key, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))})
    (out / "text_encoder" / "config.json").write_text(json.dumps(te_config, indent=2))
    index = json.loads((out / "model_index.json").read_text())
    index.update(_class_name="QwenImageEditPlusPipeline", processor=["transformers", "Qwen2VLProcessor"])
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    proc = out / "processor"
    proc.mkdir(exist_ok=True)
    for f in (out / "tokenizer").iterdir():
        shutil.copy(f, proc / f.name)
    (proc / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))
    (proc / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


def picture(size: int) -> Image.Image:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    rgb = np.stack([np.sin(7 * x), np.cos(5 * y), np.sin(3 * (x + y))], -1) * 90 + 128
    return Image.fromarray(np.clip(rgb + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8), "RGB")


def build(ckpt: Path, bundle: Path, cache: Path, size: int, backend: str) -> dict[str, float]:
    """`qic build` (a fresh process, a fresh cache): graph name -> compile seconds, from its build table."""
    cmd = [sys.executable, "-m", "qic.cli", "build", "--model", str(ckpt), "--output", str(bundle), "--cache-dir",
           str(cache), "--resolution", f"{size}x{size}", "--condition-size", f"{size}x{size}", "--condition-images",
           "1", "--text-buckets", str(BUCKET), "--backend", backend]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
    rows = re.findall(r"compile\s+│\s+(\S+)\s+│\s+built\s+│[^│]*│\s+([\d.]+)s", out)
    return {name: float(s) for name, s in rows}


def qic_side(bundle: Path, image: Image.Image, size: int, steps: int) -> tuple[dict, Image.Image]:
    from qic.models.qwen_image.host import Request, generate
    from qic.runtime.bundle import Bundle
    b = Bundle(bundle)
    r = generate(b, Request(PROMPT, negative_prompt=NEGATIVE, guidance=GUIDANCE, steps=steps, seed=SEED,
                            height=size, width=size, image=[image], nearest_condition_size=True))
    t = r.timings
    return {"vision": t["vision"], "language model": t["encode"], "vae_encoder": t["vae_encoder"],
            "steps": sum(v for k, v in t.items() if k.startswith("step")), "decoder": t["decode"]}, r.image


class _Timer:
    """Seconds spent in a module's forward (or a bound method), summed over calls; `restore` puts back what was
    there (an instance attribute, such as the text encoder's 3-D positions, included)."""

    def __init__(self, owner, name: str):
        self.seconds, real = 0.0, getattr(owner, name)
        self.owner, self.name = owner, name
        self.own = owner.__dict__.get(name)   # an instance attribute to put back, else None

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        setattr(owner, name, timed)

    def restore(self) -> None:
        if self.own is not None:
            setattr(self.owner, self.name, self.own)
        else:
            delattr(self.owner, self.name)


def diffusers_pipeline(ckpt: Path):
    import diffusers
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    te = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt / "text_encoder", dtype=torch.float32)
    forward, pad = te.forward, te.config.image_token_id
    te.forward = lambda input_ids=None, **kw: forward(input_ids=input_ids,
                                                      mm_token_type_ids=(input_ids == pad).int(), **kw)
    settings = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    cls = transformers.Qwen2VLProcessor
    parts = [a for a in cls.get_attributes() if a != "video_processor"]   # no torchvision here: images only
    with mock.patch.object(cls, "get_attributes", classmethod(lambda _: parts)):
        processor = cls(image_processor=Qwen2VLImageProcessorPil(**settings),
                        tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt / "processor"),
                        chat_template=CHAT_TEMPLATE)
    pipe = diffusers.QwenImageEditPlusPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(ckpt / "scheduler"),
        vae=diffusers.AutoencoderKLQwenImage.from_pretrained(ckpt / "vae", torch_dtype=torch.float32),
        text_encoder=te, tokenizer=transformers.AutoTokenizer.from_pretrained(ckpt / "tokenizer"),
        processor=processor,
        transformer=diffusers.QwenImageTransformer2DModel.from_pretrained(ckpt / "transformer",
                                                                          torch_dtype=torch.float32))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_side(pipe, image: Image.Image, size: int, steps: int) -> tuple[dict, Image.Image]:
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus
    te = pipe.text_encoder
    timers = {"vision": _Timer(te.model.visual, "forward"), "text encoder": _Timer(te, "forward"),
              "vae_encoder": _Timer(pipe.vae, "encode"), "steps": _Timer(pipe.transformer, "forward"),
              "decoder": _Timer(pipe.vae, "decode")}
    with mock.patch.object(plus, "VAE_IMAGE_SIZE", size * size):
        out = pipe(image=[image], prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=GUIDANCE, height=size,
                   width=size, num_inference_steps=steps, generator=torch.Generator().manual_seed(SEED)).images[0]
    secs = {k: t.seconds for k, t in timers.items()}
    for t in reversed(list(timers.values())):   # the VAE's encode and decode wrapped on one object: last first
        t.restore()
    return {"vision": secs["vision"], "language model": secs["text encoder"] - secs["vision"],
            "vae_encoder": secs["vae_encoder"], "steps": secs["steps"], "decoder": secs["decoder"]}, out


def default_build_estimate(compiled: dict[str, float]) -> tuple[int, float]:
    """(graphs, seconds) of the default Plus build at seven output presets and one bucket: per kind, this run's
    compile seconds of that kind (7 vision, 7 VAE encoder, 1 text encoder, 7 step, 7 decoder)."""
    kinds = {"vision": 7, "vae_encoder": 7, "text_encoder": 1, "denoiser": 7, "vae_decoder": 7}
    per = {k: statistics.mean(s for name, s in compiled.items() if name.startswith(k + "@")) for k in kinds}
    return sum(kinds.values()), sum(n * per[k] for k, n in kinds.items())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="the embedded tiny model's widths")
    ap.add_argument("--backend", default="inductor", help="qic's back end (export: nothing compiled)")
    ap.add_argument("--dir", default=str(REPO / "artifacts" / "edit"))
    args = parse_args(ap, argv, {"tiny": True, "size": 64, "steps": 2, "runs": 1, "dir": None,
                                         "backend": "export"})
    work = Path(args.dir) if args.dir else smoke_dir("edit")
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    ckpt = edit_checkpoint(work / ("ckpt-tiny" if args.tiny else f"ckpt-depth{args.depth}"), args.depth, args.tiny)
    shutil.rmtree(work / "bundle", ignore_errors=True)
    shutil.rmtree(work / "cache", ignore_errors=True)
    t0 = time.perf_counter()
    compiled = build(ckpt, work / "bundle", work / "cache", args.size, args.backend)
    build_s = time.perf_counter() - t0
    image = picture(args.size)
    pipe = diffusers_pipeline(ckpt)
    ours, theirs = [], []
    for _ in range(args.runs):
        q, q_img = qic_side(work / "bundle", image, args.size, args.steps)
        d, d_img = diffusers_side(pipe, image, args.size, args.steps)
        ours.append(q)
        theirs.append(d)
    diff = np.abs(np.asarray(q_img).astype(float) - np.asarray(d_img).astype(float))
    width = "tiny widths" if args.tiny else f"real widths, depth {args.depth}"
    print(f"\nedit ({width}; {args.size}x{args.size} condition and output, {args.steps} steps, true CFG; "
          f"median of {args.runs}; qic's {args.backend} bundle; torch threads {torch.get_num_threads()})\n")
    print("| stage | qic s | diffusers s | qic / diffusers |")
    print("|---|---:|---:|---:|")
    for stage in STAGES:
        a, b = (statistics.median(r[stage] for r in rs) for rs in (ours, theirs))
        print(f"| {stage} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    a, b = (statistics.median(sum(r.values()) for r in rs) for rs in (ours, theirs))
    print(f"| all stages | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    print(f"| pixel diff max / mean (of 255) | {diff.max():.0f} / {diff.mean():.4f} | | |")
    print(f"\nbuild: {len(compiled)} graphs compiled in {build_s:.0f} s "
          f"({', '.join(f'{k} {v:.0f} s' for k, v in compiled.items())})")
    graphs, seconds = default_build_estimate(compiled)
    print(f"default Plus build (7 condition sizes, 7 output presets, 1 bucket): {graphs} graphs, about "
          f"{seconds / 60:.1f} min of compiling at these per-kind times")


if __name__ == "__main__":
    main()

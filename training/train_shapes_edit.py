"""Train the embedded `shapes-edit` model: a tiny Qwen-Image-Edit-2509 (QwenImageEditPlusPipeline) that edits a
picture of the shapes world by an instruction of training/shapes_edit.py's grammar, in diffusers' own classes.

    python -m training.train_shapes_edit                # the full run (its eight cycles: about 3.6 h on 2 CPU
                                                        # cores), writes the package data in
                                                        # qic/checkpoint/data/shapes-edit/
    python -m training.train_shapes_edit --resume DIR [--steps N --lr X]   # another cosine cycle from an export
    python -m training.train_shapes_edit --resume DIR --copy-head 1:2 ...  # with that head made a copy head first
    python -m training.train_shapes_edit --smoke --out DIR   # a few iterations of every stage (make test)

It starts from the trained `shapes` model (qic/checkpoint/data/shapes/): its text encoder (random, frozen, with
its random vision tower) and VAE are kept as they are and not shipped again (the record names their sha256); only
the denoiser is trained, to read [noise | condition] tokens as Edit Plus does. Condition images keep their size on
both sides (qic.checkpoint.presets.SHAPES_EDIT: 128*128-pixel areas, where the real pipeline resizes to 1024*1024 and
384*384), so the reference pipeline runs with its two module constants patched to those areas.

Stages, seeded, on the CPU with a fixed thread count:
  1. latents: every picture of the shapes world (168 triples) at the three resolutions and a grid of sizes, encoded
     once by the VAE (posterior mode, normalised as the pipeline's _encode_vae_image).
  2. denoiser: flow matching as in training/train_shapes.py, on (input picture, instruction) -> the edited picture at
     the same size: the input's latents as the condition tokens, the prompt embedding computed per batch as the
     pipeline's encode_prompt computes it (the Edit Plus template with the picture's vision tokens; checked equal
     at the start); the instruction replaced by " " with probability CFG_DROP so true CFG works. EMA weights saved.
     The settings' `then` lists further cycles (warm restarts from the EMA weights, as --resume makes them);
     `copy_head` (or --copy-head) first makes one attention head a positional copy head (sharpen_copy_head).
  3. export: the denoiser in fp16, its sha256, the configs, the command, losses, times and the meaning check of
     held-out pairs through diffusers' pipeline in trained.json.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from training import shapes, shapes_edit
from training.train_shapes import (
    RESOLUTIONS,
    THREADS,
    add_common_args,
    log,
    mu_of,
    optimiser_step,
    pack,
    shifted,
    start,
    text_batch,
    to_tensor,
)

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "qic" / "checkpoint" / "data" / "shapes-edit"
NEGATIVE = " "
CFG_DROP = 0.15
PICTURE = "Picture 1: <|vision_start|><|image_pad|><|vision_end|>"   # the Edit Plus template's one-image part

# Noise levels: uniform, with a share of the batch at high noise (u >= high_from, before the shift), where the edit
# is decided: at sigma near 1 the picture to draw is a function of the condition and the instruction alone, and a
# run with logit-normal t (train_shapes.py's phase 2, which rarely samples there) predicted the unedited picture
# there after 1500 steps and edited none of its eval pairs.
# The full run is the chain of cycles that made the model that ships (its trained.json's `previous` records, each
# cycle once a --resume run; about 3.6 h on 2 cores): the first at uniform t with a high-noise share, two with
# logit-normal t and 20% still high, four logit-normal only, and a last one after block 1's head 2 was made a copy head.
FULL = {"sizes": 8, "steps": 4500, "batch": 32, "lr": 5e-4, "ema": 0.998, "eval_every": 750, "eval_pairs": 24,
        "t_sampling": "high", "high_share": 0.4, "high_from": 0.8,
        "then": [{"steps": 1500, "lr": 3e-4, "t_sampling": "logit_normal_high", "high_share": 0.2},
                 {"steps": 1400, "lr": 2e-4, "t_sampling": "logit_normal_high", "high_share": 0.2},
                 {"steps": 1500, "lr": 2e-4, "t_sampling": "logit_normal"},
                 {"steps": 1500, "lr": 1.5e-4, "t_sampling": "logit_normal"},
                 {"steps": 1300, "lr": 1.5e-4, "t_sampling": "logit_normal"},
                 {"steps": 1500, "lr": 1.5e-4, "t_sampling": "logit_normal"},
                 {"steps": 1500, "lr": 2e-4, "t_sampling": "logit_normal", "copy_head": "1:2"}]}
SMOKE = {"sizes": 1, "steps": 3, "batch": 4, "lr": 5e-4, "ema": 0.9, "eval_every": 0, "eval_pairs": 2,
         "t_sampling": "high", "high_share": 0.4, "high_from": 0.8, "triples": 6, "copy_head": "1:2",
         "then": [{"steps": 2, "lr": 2e-4, "t_sampling": "logit_normal", "copy_head": "3:0"}]}


@contextmanager
def condition_areas(areas: dict):
    """diffusers' Edit Plus pipeline resizing condition images to `areas` (its module constants)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus
    saved = plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE
    plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE = areas["vae"], areas["vision"]
    try:
        yield
    finally:
        plus.VAE_IMAGE_SIZE, plus.CONDITION_IMAGE_SIZE = saved


def start_pipeline(workdir: Path):
    """(configs, pipeline): the shapes model written as an Edit Plus checkpoint, loaded as the parity tests load
    edit checkpoints (tests/qwen_image_edit_checkpoint.load_pipeline: the images-only processor, 3-D positions)."""
    from qic.checkpoint import trained
    from qic.checkpoint.embedded import write_checkpoint_from_configs
    from qic.checkpoint.presets import shapes_edit_architecture
    from tests.qwen_image_edit_checkpoint import load_pipeline

    configs = shapes_edit_architecture(trained.configs("shapes"))
    root = write_checkpoint_from_configs(workdir / "start", configs, "shapes-edit-start",
                                         weights=lambda c: trained.state_dict("shapes", c))
    return configs, load_pipeline(root)


# ---- 1. latents ---------------------------------------------------------------------------------------

def sizes_of(cfg: dict) -> list[float]:
    k = cfg["sizes"]
    return list(np.linspace(*shapes.SIZE_RANGE, k)) if k > 1 else [float(np.mean(shapes.SIZE_RANGE))]


def encode_pictures(pipe, cfg: dict) -> dict:
    """(h, w) -> {(triple, size index): normalised latents [C, h/8, w/8]} for every picture of the world."""
    vae, conf = pipe.vae, pipe.vae.config
    mean = torch.tensor(conf.latents_mean).view(1, -1, 1, 1)
    std = torch.tensor(conf.latents_std).view(1, -1, 1, 1)
    triples = shapes.TRIPLES[:cfg.get("triples")]
    out = {}
    with torch.no_grad():
        for h, w in RESOLUTIONS:
            items = [(t, k, s) for t in triples for k, s in enumerate(sizes_of(cfg))]
            lats = []
            for j in range(0, len(items), 32):
                imgs = np.stack([shapes.render(*t, h, w, float(s)) for t, _, s in items[j:j + 32]])
                lats.append((vae.encode(to_tensor(imgs)).latent_dist.mode()[:, :, 0] - mean) / std)
            lat = torch.cat(lats)
            out[(h, w)] = {(t, k): lat[i] for i, (t, k, _) in enumerate(items)}
            log(f"latents {h}x{w}: {len(items)}")
    return out


# ---- 2. denoiser --------------------------------------------------------------------------------------

def encode_batch(pipe, prompts: list[str], pictures: list) -> tuple[torch.Tensor, torch.Tensor]:
    """The Edit Plus prompt embedding of each (prompt, one picture) pair, as the pipeline's encode_prompt gives it
    for that pair alone, in one text-encoder call: the template with the picture's vision tokens, the processor's
    pixels, the last hidden state less the template's dropped tokens, right-padded with a mask."""
    txt = [pipe.prompt_template_encode.format(PICTURE + p) for p in prompts]
    inputs = pipe.processor(text=txt, images=pictures, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = pipe.text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                   pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"],
                                   output_hidden_states=True).hidden_states[-1]
    rows = pipe._extract_masked_hidden(hidden, inputs["attention_mask"])
    return text_batch([r[pipe.prompt_template_encode_start_idx:] for r in rows])


def vision_picture(pipe, img: np.ndarray, areas: dict):
    """A rendered picture as the pipeline hands it to the processor: resized to its vision-side size."""
    from PIL import Image

    from qic.host.condition_images import calculate_dimensions
    pil = Image.fromarray(img)
    w, h = calculate_dimensions(areas["vision"], pil.width / pil.height)
    return pipe.image_processor.resize(pil, h, w)


def check_encoding(pipe, areas: dict) -> float:
    """encode_batch against the pipeline's own encode_prompt on three pairs of different resolutions and
    lengths: the largest absolute difference (raises when over 1e-4: the batch must be the pipeline's rows)."""
    pairs = [(shapes_edit.TRAIN[k], RESOLUTIONS[k % 3]) for k in (0, 500, 1500)]
    pics = [vision_picture(pipe, shapes.render(*t, h, w, 0.55), areas) for (_, t), (h, w) in pairs]
    prompts = [i for (i, _), _ in pairs]
    emb, mask = encode_batch(pipe, prompts, pics)
    worst = 0.0
    for j, (p, pic) in enumerate(zip(prompts, pics)):
        with torch.no_grad():
            ref, _ = pipe.encode_prompt(p, image=[pic], device="cpu")
        n = ref.shape[1]
        assert int(mask[j].sum()) == n, (int(mask[j].sum()), n)
        worst = max(worst, float((emb[j, :n] - ref[0]).abs().max()))
    if worst > 1e-4:
        raise SystemExit(f"the batched prompt encoding differs from the pipeline's by {worst}")
    log(f"batched prompt encoding = the pipeline's (max abs {worst:.1e})")
    return worst


def train_denoiser(pipe, tr, ema, data, configs, cfg, seed, losses, evals) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    areas = configs["edit"]["areas"]
    opt = torch.optim.AdamW(tr.parameters(), lr=cfg["lr"], weight_decay=0.0)
    steps = cfg["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(   # warm-up, then cosine down to a tenth
        opt, lambda i: min(1.0, (i + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / steps))))
    world = set(shapes.TRIPLES[:cfg.get("triples")])   # the smoke run's few pictures: pairs within them
    pairs = [(ins, t) for ins, t in shapes_edit.TRAIN if t in world and shapes_edit.apply(ins, t) in world]
    sizes = sizes_of(cfg)
    tr.train()
    for i in range(steps):
        h, w = RESOLUTIONS[i % len(RESOLUTIONS)]
        lat = data[(h, w)]
        picks = [pairs[k] for k in rng.integers(0, len(pairs), cfg["batch"])]
        ks = rng.integers(0, len(sizes), cfg["batch"])
        x0 = pack(torch.stack([lat[(shapes_edit.apply(ins, t), int(k))] for (ins, t), k in zip(picks, ks)]))
        cond = pack(torch.stack([lat[(t, int(k))] for (_, t), k in zip(picks, ks)]))
        prompts = [NEGATIVE if rng.random() < CFG_DROP else ins for ins, _ in picks]
        pics = [vision_picture(pipe, shapes.render(*t, h, w, float(sizes[k])), areas) for (_, t), k in zip(picks, ks)]
        txt, mask = encode_batch(pipe, prompts, pics)
        b, n = x0.shape[:2]
        if cfg["t_sampling"] in ("logit_normal", "logit_normal_high"):   # most samples at mid noise (the shapes)
            u = torch.sigmoid(torch.randn(b, generator=gen))
        else:
            u = torch.rand(b, generator=gen)
        if cfg["t_sampling"].endswith("high"):   # and a share of the batch at high noise, where the edit is decided
            high = torch.rand(b, generator=gen) < cfg["high_share"]
            r = u if cfg["t_sampling"] == "high" else torch.rand(b, generator=gen)   # "high" reuses its uniform
            u = torch.where(high, 1 - (1 - cfg["high_from"]) * r, u)
        u = u.clamp(1e-4, 1 - 1e-4)
        s = shifted(u, mu_of(n, configs["scheduler"])).view(b, 1, 1)
        noise = torch.randn(x0.shape, generator=gen)
        xt = (1 - s) * x0 + s * noise
        v = tr(hidden_states=torch.cat([xt, cond], 1), encoder_hidden_states=txt, encoder_hidden_states_mask=mask,
               timestep=s.view(b), img_shapes=[[(1, h // 16, w // 16)] * 2] * b, return_dict=False)[0][:, :n]
        loss = (v - (noise - x0)).pow(2).mean()
        optimiser_step(loss, tr, ema, opt, sched, i, cfg["ema"])
        losses.append((i, loss.item()))
        if i % 50 == 0 or i == steps - 1:
            log(f"denoiser {i}/{steps} loss {loss.item():.4f} lr {sched.get_last_lr()[0]:.2e}")
        if cfg["eval_every"] and (i + 1) % cfg["eval_every"] == 0:
            evals.append((i + 1, evaluate(pipe, ema, areas, cfg["eval_pairs"])))
            tr.train()
    tr.eval()


def sharpen_copy_head(transformer, block: int, head: int, margin: float = 4.5) -> None:
    """Make one attention head of the image stream a positional copy head: each image token attends to the token at
    its own place one frame on (a noise token to the condition token under it), nearly alone.

    Why: the denoiser's QK-norm caps a head's scores at sqrt(head_dim) times its gains, and the RoPE frequencies
    that tell neighbouring tokens apart are a few dims of each head. After ~10 000 steps the head that had learnt to
    copy the condition (block 1, head 2) put 0.37 of its attention on the token under it and the rest around it, and
    the edits came out blurred (triangles drawn as bells); gradient descent raises those gains only slowly (each is
    shared by the block's heads). Here the head's queries and keys get constant values in the pairs of the highest
    frame frequency and the two highest height and width frequencies (their projection rows zeroed, their biases
    far above the content rows, so they carry the head's norm), the query's frame pair turned by one frame's angle,
    and those dims' gains raised so that the token one place off, or the one at the same place in the same frame,
    scores about `margin` less than the one copied. The block's other heads get their rows in those dims scaled down
    by the gains' factors (their scores about unchanged). The head's values and output projection are kept."""
    cfg = transformer.config
    attn = transformer.transformer_blocks[block].attn
    d = cfg.attention_head_dim
    frame, height, _ = cfg.axes_dims_rope     # QwenEmbedRope: frame, height, width pairs, highest frequency first
    pairs = (0, frame // 2, frame // 2 + 1, (frame + height) // 2, (frame + height) // 2 + 1)
    dims = torch.tensor([2 * p + j for p in pairs for j in (0, 1)])
    theta = 10000.0                           # QwenEmbedRope's
    lost = sum(1 - math.cos(theta ** (-2 * j / height)) for j in (0, 1))   # one place off along an axis
    per_pair = margin / lost                  # score of one matched pair: (d / pairs) * gain**2 / sqrt(d)
    gain = math.sqrt(per_pair * math.sqrt(d) * len(pairs) / d)
    with torch.no_grad():
        for proj, norm in ((attn.to_q, attn.norm_q), (attn.to_k, attn.norm_k)):
            old = norm.weight[dims].clone()
            w, b = proj.weight.view(-1, d, proj.in_features), proj.bias.view(-1, d)
            for h in range(w.shape[0]):
                if h != head:
                    w[h, dims] *= (old / gain)[:, None]
                    b[h, dims] *= old / gain
            size = 30 * float(w[head].norm(dim=1).max()) + 1.0
            w[head, dims] = 0.0
            b[head, dims] = 0.0
            b[head, dims[0::2]] = size
            if proj is attn.to_q:             # frame pair at frequency 1: the score peaks at f_key - f_query = 1
                b[head, dims[0]], b[head, dims[1]] = size * math.cos(1.0), size * math.sin(1.0)
            norm.weight[dims] = gain


def block_head(spec: str) -> tuple[int, int]:
    """"BLOCK:HEAD" (--copy-head, the settings' copy_head) -> (block, head)."""
    block, head = (int(x) for x in str(spec).split(":"))
    return block, head


def as_exported(state: dict) -> dict:
    """A state dict as export() writes it and --resume reads it back: rounded to fp16, in fp32."""
    return {k: v.detach().to(torch.float16).float() for k, v in state.items()}


def evaluate(pipe, transformer, areas: dict, n: int, steps: int = 20, seed: int = 0) -> dict:
    """Fraction of edits the meaning check passes (diffusers' Edit Plus pipeline, true CFG 4, negative " ", 20
    steps), over n held-out and n training pairs, each picture at 128x128 with a shape of middling size (the output
    size given: the pipeline's default is the last picture's aspect at 1024*1024 pixels, a constant apart from
    VAE_IMAGE_SIZE)."""
    from PIL import Image
    pipe.transformer = transformer.eval()
    out = {}
    for name, pairs in (("held_out", shapes_edit.HELD_OUT), ("train", shapes_edit.TRAIN)):
        ok = 0
        chosen = shapes_edit.check_pairs(n, pairs)
        pipe.set_progress_bar_config(disable=True)
        for ins, t in chosen:
            picture = Image.fromarray(shapes.render(*t, 128, 128, 0.55))
            with torch.no_grad(), condition_areas(areas):
                img = pipe(image=[picture], prompt=ins, negative_prompt=NEGATIVE, true_cfg_scale=4.0,
                           num_inference_steps=steps, output_type="np", height=128, width=128,
                           generator=torch.Generator().manual_seed(seed)).images[0]
            ok += shapes_edit.edited_as_told((img * 255).round().clip(0, 255).astype(np.uint8), ins, t)
        out[name] = ok / len(chosen)
    log(f"eval {out}")
    return out


# ---- 3. export ----------------------------------------------------------------------------------------

def export(out_dir: Path, transformer_sd: dict, configs: dict, record: dict) -> dict:
    """The denoiser (fp16) and trained.json: the configs, the files (this model's and, under `base`, the shapes
    model's text encoder and VAE by their sha256, which the loader checks), the training record."""
    from safetensors.torch import save_file

    from qic.checkpoint import trained
    out_dir.mkdir(parents=True, exist_ok=True)
    half = {k: v.detach().to(torch.float16).contiguous() for k, v in transformer_sd.items()}
    if not all(torch.isfinite(v).all() for v in half.values()):
        raise RuntimeError("transformer: tensors overflow fp16")
    path = out_dir / "transformer.safetensors"
    tmp = path.with_suffix(".tmp")
    save_file(half, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)
    tmp.replace(path)
    base = {f: trained.record("shapes")["files"][f] for f in ("text_encoder.safetensors", "vae.safetensors")}
    meta = {"configs": configs, "files": {path.name: hashlib.sha256(path.read_bytes()).hexdigest()},
            "base": {"model": "shapes", "files": base}, "training": record}
    tmp = out_dir / "trained.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    tmp.replace(out_dir / "trained.json")
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, DATA_DIR)
    ap.add_argument("--resume", type=Path, default=None,
                    help="an earlier export of this script: another cosine cycle (a warm restart, fresh optimiser) "
                         "from its denoiser, as train_shapes' phase 2")
    ap.add_argument("--steps", type=int, default=None, help="denoiser steps (default: the settings')")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the settings')")
    ap.add_argument("--t-sampling", choices=("uniform", "high", "logit_normal", "logit_normal_high"), default=None,
                    help="noise levels (default: the settings'); *_high: with high_share of the batch at u >= "
                         "high_from")
    ap.add_argument("--high-share", type=float, default=None, help="(default: the settings')")
    ap.add_argument("--high-from", type=float, default=None, help="(default: the settings')")
    ap.add_argument("--copy-head", default=None, metavar="BLOCK:HEAD",
                    help="before training, make this attention head a positional copy head (sharpen_copy_head)")
    args = ap.parse_args(argv)
    cfg, out = start(args, ap, FULL, SMOKE, DATA_DIR)
    overrides = (("steps", args.steps), ("lr", args.lr), ("t_sampling", args.t_sampling),
                 ("high_share", args.high_share), ("high_from", args.high_from), ("copy_head", args.copy_head))
    cfg = cfg | {k: v for k, v in overrides if v is not None}
    if args.resume or any(v is not None for k, v in overrides if k != "copy_head"):
        cfg["then"] = []                  # one cycle (another from an export, or the settings given)
    if args.resume and not args.copy_head:
        cfg["copy_head"] = None           # the export resumed from has its heads as they were trained
    previous = None
    if args.resume:
        from safetensors.torch import load
        previous = json.loads((args.resume / "trained.json").read_text())
        data = (args.resume / "transformer.safetensors").read_bytes()
        if hashlib.sha256(data).hexdigest() != previous["files"]["transformer.safetensors"]:
            raise SystemExit(f"{args.resume / 'transformer.safetensors'}: sha256 differs from its trained.json")
        resumed = {k: v.float() for k, v in load(data).items()}
    t0, times = time.time(), {}
    with tempfile.TemporaryDirectory(prefix="qic-shapes-edit-") as tmp:
        configs, pipe = start_pipeline(Path(tmp))
        if previous is not None:
            pipe.transformer.load_state_dict(resumed)
        if cfg.get("copy_head"):
            sharpen_copy_head(pipe.transformer, *block_head(cfg["copy_head"]))
        areas = configs["edit"]["areas"]
        encoding = check_encoding(pipe, areas)
        t = time.time()
        data = encode_pictures(pipe, cfg)
        times["latents_s"] = time.time() - t
        before = evaluate(pipe, pipe.transformer, areas, cfg["eval_pairs"]) if not args.smoke else {}
        tr = pipe.transformer
        ema = copy.deepcopy(tr).requires_grad_(False)
        losses, evals = [], []
        t = time.time()
        done = 0
        for k, cycle in enumerate([{}] + cfg.get("then", [])):
            if k:
                # a warm restart as a --resume run makes one: the exported (fp16) EMA weights, the cycle's copy
                # head made on them (saved in fp16, as run 6's start was), a fresh optimiser and EMA, the same seed
                tr.load_state_dict(as_exported(ema.state_dict()))
                if cycle.get("copy_head"):
                    sharpen_copy_head(tr, *block_head(cycle["copy_head"]))
                    tr.load_state_dict(as_exported(tr.state_dict()))
                ema.load_state_dict(tr.state_dict())
            n_losses, n_evals, settings = len(losses), len(evals), cfg | cycle
            train_denoiser(pipe, tr, ema, data, configs, settings, args.seed + 1, losses, evals)
            losses[n_losses:] = [(done + i, v) for i, v in losses[n_losses:]]
            evals[n_evals:] = [(done + i, v) for i, v in evals[n_evals:]]
            done += settings["steps"]
        times["denoiser_s"] = time.time() - t
        final = evaluate(pipe, ema, areas, 2 * cfg["eval_pairs"]) if not args.smoke else {}
        record = {
            "command": "python -m training.train_shapes_edit" + (" --smoke" if args.smoke else "")
                       + "".join(f" --{k.replace('_', '-')} {v}" for k, v in (("resume", args.resume), *overrides)
                                 if v is not None),
            "previous": previous and {"files": previous["files"], "training": previous["training"]},
            "seed": args.seed, "threads": THREADS, "settings": cfg, "cfg_drop": CFG_DROP,
            "resolutions": [list(r) for r in RESOLUTIONS], "negative_prompt": NEGATIVE, "torch": torch.__version__,
            "prompt_encoding_max_abs": encoding, "eval_before_training": before,
            "seconds": {k: round(v, 1) for k, v in times.items()} | {"total_s": round(time.time() - t0, 1)},
            "final_denoiser_loss_mean_last_100": float(np.mean([v for _, v in losses[-100:]])),
            "evals": evals, "final_eval_20_steps_cfg4": final,
        }
        meta = export(out, ema.state_dict(), configs, record)
    (out / "losses.json").write_text(json.dumps({"denoiser": losses}))   # not package data
    log(f"done in {time.time() - t0:.0f} s: {out} {json.dumps(meta['files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

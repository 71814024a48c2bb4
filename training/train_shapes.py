"""Train the embedded `shapes` model: a tiny Qwen-Image that draws `a {colour} {shape} on a {background}
background` (training/shapes.py), in diffusers' own classes so `QwenImagePipeline` loads the result as is.

    python -m training.train_shapes            # the full run (80 min on 2 CPU cores), writes the
                                               # package data in qic/checkpoint/data/shapes/
    python -m training.train_shapes --phase1 DIR   # phase 2 only, from an earlier phase-1 export (--work)
    python -m training.train_shapes --smoke --out DIR    # a few iterations of every stage (make test)

Stages, each seeded and run on the CPU with a fixed thread count, so a run is repeatable on one machine:
  1. text: the tiny random text encoder (qic's `tiny` recipe, frozen) encodes every prompt of the grammar
     and the negative prompt " " through the pipeline's own `encode_prompt` (the real template, 34 dropped).
  2. vae: AutoencoderKLQwenImage, encoder and decoder, trained on 64x64 crops of rendered pictures
     (reconstruction L1 + L2, a small KL term so sampled latents decode too).
  3. latents: every training triple at the three resolutions and a grid of sizes, encoded once (posterior
     mode); their per-channel mean/std become the VAE config's latents_mean/latents_std.
  4. denoiser: QwenImageTransformer2DModel by flow matching as Qwen-Image samples: sigma from u (U(0,1) in
     phase 1, logit-normal in phase 2) shifted by the scheduler's exponential time shift at the resolution's
     mu, x_t = (1-s) x0 + s noise,
     velocity target noise - x0, timestep s; the prompt replaced by " " with probability CFG_DROP so true
     CFG works; an EMA of the weights is what is saved. Two cosine cycles: phase 1 from scratch (exported
     like the final weights), phase 2 a warm restart from phase 1's exported fp16 EMA weights and VAE, with
     a fresh optimiser (so `--phase1 DIR` resumes exactly where a full run would).
  5. export: fp16 safetensors (fp16 -> fp32 at build is exact), their sha256, the configs, the command,
     the losses and times in trained.json, and the loss curves in docs/img/shapes-training-loss.png.
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
from pathlib import Path

import numpy as np
import torch

from training import shapes

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT / "qic" / "checkpoint" / "data" / "shapes"
PLOT = ROOT / "docs" / "img" / "shapes-training-loss.png"
RESOLUTIONS = ((128, 128), (96, 160), (160, 96))   # (height, width)
NEGATIVE = " "
CFG_DROP = 0.15
THREADS = 2

# The denoiser trains in two cosine cycles: phase 1 from scratch, then phase 2 (a warm restart) from phase 1's
# exported EMA weights.
FULL = {"vae_steps": 1600, "vae_batch": 8, "vae_lr": 5e-4, "sizes": 12,
        "dit_steps": 5000, "dit_batch": 64, "dit_lr": 5e-4, "ema": 0.999, "eval_every": 1000,
        "phase2_steps": 7000, "phase2_lr": 4e-4, "phase2_t_sampling": "logit_normal"}
SMOKE = {"vae_steps": 3, "vae_batch": 2, "vae_lr": 5e-4, "sizes": 1,
         "dit_steps": 3, "dit_batch": 4, "dit_lr": 5e-4, "ema": 0.9, "eval_every": 0,
         "phase2_steps": 2, "phase2_lr": 4e-4, "phase2_t_sampling": "logit_normal", "triples": 6}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def architecture() -> dict:
    from qic.checkpoint.presets import shapes_architecture
    return shapes_architecture()


# ---- 1. text ------------------------------------------------------------------------------------------

def pipeline_of(configs: dict, workdir: Path):
    """A QwenImagePipeline on a checkpoint of these configs with qic's random recipe (its text encoder and
    tokenizer are the ones the trained model keeps)."""
    from diffusers import QwenImagePipeline

    from qic.checkpoint.embedded import write_checkpoint_from_configs
    ckpt = write_checkpoint_from_configs(workdir / "init", configs, "shapes-init", seed=0)
    return QwenImagePipeline.from_pretrained(ckpt, torch_dtype=torch.float32), ckpt


def encode_prompts(pipe) -> dict[str, torch.Tensor]:
    """prompt -> [L, D] last hidden state after the template, for every prompt of the grammar and " "."""
    prompts = [shapes.prompt_of(*t) for t in shapes.TRIPLES] + [NEGATIVE]
    out = {}
    with torch.no_grad():
        for p in prompts:
            emb, mask = pipe.encode_prompt(p, device="cpu")
            assert mask is None or bool(mask.all())
            out[p] = emb[0].clone()
    return out


def text_batch(embeds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest, with the boolean mask diffusers' transformer takes."""
    n = max(e.shape[0] for e in embeds)
    x = torch.zeros(len(embeds), n, embeds[0].shape[1])
    m = torch.zeros(len(embeds), n, dtype=torch.bool)
    for i, e in enumerate(embeds):
        x[i, :e.shape[0]] = e
        m[i, :e.shape[0]] = True
    return x, m


# ---- 2. vae -------------------------------------------------------------------------------------------

def to_tensor(imgs: np.ndarray) -> torch.Tensor:
    """[B, H, W, 3] uint8 -> [B, 3, 1, H, W] in [-1, 1] (one frame)."""
    return torch.from_numpy(imgs).float().div(127.5).sub(1).permute(0, 3, 1, 2).unsqueeze(2)


def vae_batch(rng: np.random.Generator, n: int, crop: int = 64) -> torch.Tensor:
    """n random crops of rendered training pictures: edges, corners and flat colour at every scale used."""
    out = []
    for _ in range(n):
        h, w = RESOLUTIONS[rng.integers(len(RESOLUTIONS))]
        _, img = shapes.sample(rng, h, w)
        y, x = rng.integers(0, h - crop + 1), rng.integers(0, w - crop + 1)
        out.append(img[y:y + crop, x:x + crop])
    return to_tensor(np.stack(out))


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """vae.decode without its final clamp to [-1, 1] (one frame): a clamped output passes no gradient,
    and the randomly initialised decoder starts mostly outside that range."""
    vae.clear_cache()
    vae._conv_idx = [0]
    out = vae.decoder(vae.post_quant_conv(z), feat_cache=vae._feat_map, feat_idx=vae._conv_idx)
    vae.clear_cache()
    return out


def train_vae(vae, cfg: dict, seed: int, losses: list) -> None:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg["vae_lr"], weight_decay=0.0)
    steps = cfg["vae_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * i / steps)))
    # The posterior's log-variance starts at -6 (std 0.05), not 0: at std 1 the decoder would first see
    # latents that are mostly noise and learn little beyond the mean colour; the KL term lets it grow.
    z_dim = vae.config.z_dim
    with torch.no_grad():
        vae.quant_conv.bias[z_dim:] = -6.0
    vae.train()
    for i in range(steps):
        x = vae_batch(rng, cfg["vae_batch"])
        dist = vae.encode(x).latent_dist
        z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=gen)
        y = decode_unclamped(vae, z)
        rec = (y - x).abs().mean() + (y - x).pow(2).mean()
        kl = 0.5 * (dist.mean.pow(2) + dist.var - 1 - dist.logvar).mean()
        loss = rec + 1e-4 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append((i, float(rec)))
        if i % 100 == 0 or i == steps - 1:
            log(f"vae {i}/{steps} rec {float(rec):.4f} kl {float(kl):.3f}")
    vae.eval()


def reconstruction_check(vae, n: int = 24) -> dict:
    """Held-out pictures through encode (mode) and decode at 128x128: mean/max pixel error and how many
    still mean their prompt."""
    rng = np.random.default_rng(123)
    errs, ok, worst = [], 0, 0.0
    with torch.no_grad():
        for t in shapes.HELD_OUT[:n]:
            img = shapes.render(*t, 128, 128, float(rng.uniform(*shapes.SIZE_RANGE)))
            y = vae.decode(vae.encode(to_tensor(img[None])).latent_dist.mode()).sample[0, :, 0]
            rec = ((y.clamp(-1, 1) + 1) * 127.5).round().permute(1, 2, 0).numpy().astype(np.uint8)
            d = np.abs(rec.astype(float) - img)
            errs.append(d.mean())
            worst = max(worst, float(d.max()))
            ok += shapes.means(rec, shapes.prompt_of(*t))
    out = {"mean_abs_255": float(np.mean(errs)), "max_abs_255": worst, "means_prompt": ok / len(errs)}
    log(f"vae reconstruction {out}")
    return out


# ---- 3. latents ---------------------------------------------------------------------------------------

def encode_dataset(vae, cfg: dict) -> dict[tuple[int, int], tuple[torch.Tensor, list[str]]]:
    """(h, w) -> (latent modes [N, C, h/8, w/8], prompts): every training triple at `sizes` sizes."""
    k = cfg["sizes"]
    sizes = np.linspace(*shapes.SIZE_RANGE, k) if k > 1 else [float(np.mean(shapes.SIZE_RANGE))]
    data = {}
    with torch.no_grad():
        for h, w in RESOLUTIONS:
            items = [(t, s) for t in shapes.TRAIN[:cfg.get("triples")] for s in sizes]
            lats = []
            for j in range(0, len(items), 32):
                imgs = np.stack([shapes.render(*t, h, w, float(s)) for t, s in items[j:j + 32]])
                lats.append(vae.encode(to_tensor(imgs)).latent_dist.mode()[:, :, 0])
            data[(h, w)] = (torch.cat(lats), [shapes.prompt_of(*t) for t, _ in items])
            log(f"latents {h}x{w}: {len(items)}")
    return data


def latent_stats(data) -> tuple[list[float], list[float]]:
    z = torch.cat([lat.permute(1, 0, 2, 3).flatten(1) for lat, _ in data.values()], dim=1)
    return [round(float(v), 4) for v in z.mean(1)], [round(float(v), 4) for v in z.std(1)]


# ---- 4. denoiser --------------------------------------------------------------------------------------

def pack(lat: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)(W/2), 4C], diffusers' packing order."""
    b, c, h, w = lat.shape
    return lat.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def mu_of(seq_len: int, sched: dict) -> float:
    """The scheduler's dynamic shift at this image sequence length (linear through the two anchors)."""
    m = (sched["max_shift"] - sched["base_shift"]) / (sched["max_image_seq_len"] - sched["base_image_seq_len"])
    return seq_len * m + sched["base_shift"] - m * sched["base_image_seq_len"]


def shifted(u: torch.Tensor, mu: float) -> torch.Tensor:
    """The exponential time shift FlowMatchEulerDiscreteScheduler applies to its sigmas."""
    return math.exp(mu) / (math.exp(mu) + (1 / u - 1))


def optimiser_step(loss, tr, ema, opt, sched, i: int, ema_decay: float) -> None:
    """One step of the denoiser's optimiser (gradients clipped to norm 1) and of its EMA, whose decay warms up as
    (1 + i) / (10 + i) to `ema_decay`."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
    opt.step()
    sched.step()
    d = min(ema_decay, (1 + i) / (10 + i))
    with torch.no_grad():
        for pe, p in zip(ema.parameters(), tr.parameters()):
            pe.lerp_(p, 1 - d)


def train_denoiser(tr, ema, data, embeds, configs, cfg, seed, losses, evals, pipe) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(tr.parameters(), lr=cfg["dit_lr"], weight_decay=0.0)
    steps = cfg["dit_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(   # warm-up, then cosine down to a tenth
        opt, lambda i: min(1.0, (i + 1) / 200) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / steps))))
    mean = torch.tensor(configs["vae"]["latents_mean"]).view(1, -1, 1, 1)
    std = torch.tensor(configs["vae"]["latents_std"]).view(1, -1, 1, 1)
    neg = embeds[NEGATIVE]
    tr.train()
    for i in range(steps):
        h, w = RESOLUTIONS[i % len(RESOLUTIONS)]
        lat, prompts = data[(h, w)]
        idx = rng.integers(0, lat.shape[0], cfg["dit_batch"])
        x0 = pack((lat[idx] - mean) / std)
        txt, mask = text_batch([neg if rng.random() < CFG_DROP else embeds[prompts[j]] for j in idx])
        b = x0.shape[0]
        if cfg.get("t_sampling", "uniform") == "logit_normal":   # SD3's: most samples at mid-range noise
            u = torch.sigmoid(torch.randn(b, generator=gen)).clamp(1e-4, 1 - 1e-4)
        else:
            u = torch.rand(b, generator=gen).clamp(1e-4, 1 - 1e-4)
        s = shifted(u, mu_of(x0.shape[1], configs["scheduler"])).view(b, 1, 1)
        noise = torch.randn(x0.shape, generator=gen)
        xt = (1 - s) * x0 + s * noise
        v = tr(hidden_states=xt, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=s.view(b),
               img_shapes=[(1, h // 16, w // 16)] * b, return_dict=False)[0]
        loss = (v - (noise - x0)).pow(2).mean()
        optimiser_step(loss, tr, ema, opt, sched, i, cfg["ema"])
        losses.append((i, float(loss)))
        if i % 100 == 0 or i == steps - 1:
            log(f"denoiser {i}/{steps} loss {float(loss):.4f} lr {sched.get_last_lr()[0]:.2e}")
        if cfg["eval_every"] and (i + 1) % cfg["eval_every"] == 0:
            evals.append((i + 1, evaluate(pipe, ema, embeds, n=24)))
            tr.train()
    tr.eval()


def evaluate(pipe, transformer, embeds, n: int, steps: int = 20, seed: int = 0) -> dict:
    """Fraction of images that mean their prompt (diffusers' pipeline, true CFG 4, negative " "), over the
    first n held-out and n training triples, at 128x128."""
    pipe.transformer = transformer.eval()
    out = {}
    for name, triples in (("held_out", shapes.HELD_OUT), ("train", shapes.TRAIN[::max(1, len(shapes.TRAIN) // n)])):
        triples = triples[:n]
        prompts = [shapes.prompt_of(*t) for t in triples]
        pe, pm = text_batch([embeds[p] for p in prompts])
        ne, nm = text_batch([embeds[NEGATIVE]] * len(prompts))
        with torch.no_grad():
            imgs = pipe(prompt_embeds=pe, prompt_embeds_mask=pm, negative_prompt_embeds=ne,
                        negative_prompt_embeds_mask=nm, true_cfg_scale=4.0, num_inference_steps=steps,
                        height=128, width=128, output_type="np",
                        generator=torch.Generator().manual_seed(seed)).images
        ok = [shapes.means((img * 255).round().clip(0, 255).astype(np.uint8), p) for img, p in zip(imgs, prompts)]
        out[name] = sum(ok) / len(ok)
    log(f"eval {out}")
    return out


# ---- 5. export ----------------------------------------------------------------------------------------

def export(out_dir: Path, modules: dict, configs: dict, record: dict) -> dict:
    from safetensors.torch import save_file
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, sd in modules.items():
        half = {k: v.detach().to(torch.float16).contiguous() for k, v in sd.items()}
        bad = [k for k, v in half.items() if not torch.isfinite(v).all()]
        if bad:
            raise RuntimeError(f"{name}: tensors overflow fp16: {bad[:3]}")
        path = out_dir / f"{name}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(half, str(tmp), metadata={"format": "pt"})
        tmp.chmod(0o644)   # package data: safetensors writes 0600
        tmp.replace(path)
        files[f"{name}.safetensors"] = hashlib.sha256(path.read_bytes()).hexdigest()
    meta = {"configs": configs, "files": files, "training": record}
    tmp = out_dir / "trained.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    tmp.replace(out_dir / "trained.json")
    return meta


def plot(vae_losses, dit_losses, path: Path, restart: int | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(v, k=50):
        v = np.asarray(v, float)
        return np.convolve(v, np.ones(k) / k, mode="valid") if len(v) > k else v

    # Without phase 1's losses.json (e.g. phase 2 rerun from a kept export) only phase 2 can be drawn.
    panels = ((("VAE reconstruction (L1 + L2)", vae_losses),) if vae_losses else ()) + (
        ("denoiser flow-matching MSE" + ("" if vae_losses else " (phase 2 only)"), dit_losses),)
    fig, ax = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    ax = ax[0]
    for a, (title, ls) in zip(ax, panels):
        y = [v for _, v in ls]
        a.plot(y, alpha=0.3, lw=0.5, label="per step")
        a.plot(np.arange(len(smooth(y))) + (len(y) - len(smooth(y))) // 2, smooth(y), lw=1.5, label="mean of 50")
        a.set_yscale("log")
        if restart and ls is dit_losses:
            a.axvline(restart, color="grey", ls=":", lw=1, label="phase 2 (warm restart)")
        a.set_title(title)
        a.set_xlabel("step")
        a.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def phase1(args, cfg: dict, out: Path) -> tuple[dict, list, list]:
    """Stages 1-5 from scratch: text, VAE, latents, the denoiser's first cosine cycle, export to `out`."""
    t0 = time.time()
    times = {}
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    configs = architecture()
    with tempfile.TemporaryDirectory(prefix="qic-shapes-") as tmp:
        pipe, _ = pipeline_of(configs, Path(tmp))
        embeds = encode_prompts(pipe)
        times["text_s"] = time.time() - t0
        log(f"text: {len(embeds)} prompts, lengths {sorted({e.shape[0] for e in embeds.values()})}")

        torch.manual_seed(args.seed + 1)
        vae_cfg = {k: v for k, v in configs["vae"].items() if not k.startswith("_")}
        vae = AutoencoderKLQwenImage(**vae_cfg)
        vae_losses, dit_losses, evals = [], [], []
        t = time.time()
        train_vae(vae, cfg, args.seed + 2, vae_losses)
        times["vae_s"] = time.time() - t
        vae_check = reconstruction_check(vae)

        t = time.time()
        data = encode_dataset(vae, cfg)
        configs["vae"]["latents_mean"], configs["vae"]["latents_std"] = latent_stats(data)
        times["latents_s"] = time.time() - t
        log(f"latents_mean {configs['vae']['latents_mean']}\nlatents_std {configs['vae']['latents_std']}")

        torch.manual_seed(args.seed + 3)
        tr_cfg = {k: v for k, v in configs["transformer"].items() if not k.startswith("_")}
        tr = QwenImageTransformer2DModel(**tr_cfg)
        ema = copy.deepcopy(tr).requires_grad_(False)
        pipe.vae = vae
        pipe.vae.register_to_config(latents_mean=configs["vae"]["latents_mean"],
                                    latents_std=configs["vae"]["latents_std"])
        t = time.time()
        train_denoiser(tr, ema, data, embeds, configs, cfg, args.seed + 4, dit_losses, evals, pipe)
        times["denoiser_s"] = time.time() - t

        final = evaluate(pipe, ema, embeds, n=17) if not args.smoke else {}
        record = {
            "command": "python -m training.train_shapes" + (" --smoke" if args.smoke else ""),
            "seed": args.seed, "threads": THREADS, "settings": cfg, "cfg_drop": CFG_DROP,
            "resolutions": [list(r) for r in RESOLUTIONS], "negative_prompt": NEGATIVE,
            "torch": torch.__version__,
            "seconds": {k: round(v, 1) for k, v in times.items()} | {"total_s": round(time.time() - t0, 1)},
            "final_vae_loss_mean_last_100": float(np.mean([v for _, v in vae_losses[-100:]])),
            "final_denoiser_loss_mean_last_100": float(np.mean([v for _, v in dit_losses[-100:]])),
            "vae_reconstruction": vae_check, "evals": evals, "final_eval_20_steps_cfg4": final,
        }
        from qic.checkpoint.embedded import component_state_dict
        te = component_state_dict("text_encoder", configs["text_encoder"], seed=0)   # as the checkpoint names them
        meta = export(out, {"transformer": ema.state_dict(), "vae": vae.state_dict(), "text_encoder": te},
                      configs, record)
    (out / "losses.json").write_text(json.dumps({"vae": vae_losses, "denoiser": dit_losses}))
    log(f"phase 1 done in {time.time() - t0:.0f} s: {out} {json.dumps(meta['files'])}")
    return meta, vae_losses, dit_losses


PHASE1_KEYS = ("vae_steps", "vae_batch", "vae_lr", "sizes", "dit_steps", "dit_batch", "dit_lr", "ema")


def load_export(folder: Path) -> tuple[dict, dict]:
    """(trained.json, {component: fp32 state dict}) of an export, each file checked against its sha256."""
    from safetensors.torch import load
    meta = json.loads((folder / "trained.json").read_text())
    sds = {}
    for fname, digest in meta["files"].items():
        data = (folder / fname).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise SystemExit(f"{folder / fname}: sha256 differs from its trained.json")
        sds[fname.removesuffix(".safetensors")] = {k: v.float() for k, v in load(data).items()}
    return meta, sds


def phase2(args, cfg: dict, first: Path, out: Path) -> tuple[dict, list]:
    """The denoiser's second cosine cycle (a warm restart): from phase 1's exported fp16 EMA weights, with
    phase 1's VAE (fp16) and latent statistics, a fresh optimiser, `phase2_steps` at `phase2_lr`."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    t0 = time.time()
    meta1, sds = load_export(first)
    want = {k: cfg[k] for k in PHASE1_KEYS}
    got = {k: meta1["training"]["settings"].get(k) for k in PHASE1_KEYS}
    if got != want or meta1["training"]["seed"] != args.seed:
        raise SystemExit(f"{first}: phase 1 was run with other settings ({got}, seed {meta1['training']['seed']}) "
                         f"than these ({want}, seed {args.seed})")
    configs = meta1["configs"]
    with tempfile.TemporaryDirectory(prefix="qic-shapes-") as tmp:
        pipe, _ = pipeline_of(configs, Path(tmp))
        embeds = encode_prompts(pipe)
        vae = AutoencoderKLQwenImage(**{k: v for k, v in configs["vae"].items() if not k.startswith("_")})
        vae.load_state_dict(sds["vae"])
        vae.eval()
        data = encode_dataset(vae, cfg)
        tr = QwenImageTransformer2DModel(**{k: v for k, v in configs["transformer"].items() if not k.startswith("_")})
        tr.load_state_dict(sds["transformer"])
        ema = copy.deepcopy(tr).requires_grad_(False)
        pipe.vae = vae
        losses, evals = [], []
        c2 = {**cfg, "dit_steps": cfg["phase2_steps"], "dit_lr": cfg["phase2_lr"],
              "t_sampling": cfg.get("phase2_t_sampling", "uniform")}
        t = time.time()
        train_denoiser(tr, ema, data, embeds, configs, c2, args.seed + 5, losses, evals, pipe)
        seconds = time.time() - t
        final = evaluate(pipe, ema, embeds, n=17) if not args.smoke else {}
        record = dict(meta1["training"])
        record.update({
            "phase1": {k: meta1["training"][k] for k in ("seconds", "final_denoiser_loss_mean_last_100", "evals",
                                                         "final_eval_20_steps_cfg4")},
            "settings": cfg,
            "seconds": {**meta1["training"]["seconds"], "phase2_s": round(time.time() - t0, 1),
                        "phase2_denoiser_s": round(seconds, 1),
                        "total_s": round(meta1["training"]["seconds"]["total_s"] + time.time() - t0, 1)},
            "final_denoiser_loss_mean_last_100": float(np.mean([v for _, v in losses[-100:]])),
            "evals": evals, "final_eval_20_steps_cfg4": final,
        })
        meta = export(out, {"transformer": ema.state_dict(), "vae": sds["vae"], "text_encoder": sds["text_encoder"]},
                      configs, record)
    (out / "losses-phase2.json").write_text(json.dumps({"denoiser": losses}))   # not package data
    log(f"phase 2 done in {time.time() - t0:.0f} s: {out} {json.dumps(meta['files'])}")
    return meta, losses


def add_common_args(ap: argparse.ArgumentParser, data_dir: Path) -> None:
    """The training scripts' shared flags: --smoke, --out, --seed."""
    ap.add_argument("--smoke", action="store_true", help="a few iterations of every stage")
    ap.add_argument("--out", type=Path, default=None, help=f"output folder (default {data_dir})")
    ap.add_argument("--seed", type=int, default=0)


def start(args, ap: argparse.ArgumentParser, full: dict, smoke: dict, data_dir: Path) -> tuple[dict, Path]:
    """(settings, output folder) of a run; the package data is written only by a full run. Seeds torch and fixes
    the thread count, so a run repeats on one machine."""
    out = args.out or (None if args.smoke else data_dir)
    if out is None:
        ap.error("--smoke needs --out (the package data is written only by a full run)")
    torch.set_num_threads(THREADS)
    torch.manual_seed(args.seed)
    return (smoke if args.smoke else full), out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap, DATA_DIR)
    ap.add_argument("--work", type=Path, default=None,
                    help="where phase 1's export goes (default OUT/../shapes-phase1, or a temporary folder)")
    ap.add_argument("--phase1", type=Path, default=None,
                    help="an earlier phase-1 export of these settings: run phase 2 only, from it")
    ap.add_argument("--plot", type=Path, default=None, help=f"loss plot (default {PLOT}; none in smoke mode)")
    args = ap.parse_args(argv)
    cfg, out = start(args, ap, FULL, SMOKE, DATA_DIR)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="qic-shapes-phase1-") as tmp:
        first = args.phase1
        if first is None:
            first = args.work or Path(tmp)
            phase1(args, cfg, first)
        _, losses2 = phase2(args, cfg, first, out)
        losses1 = json.loads((first / "losses.json").read_text()) if (first / "losses.json").exists() else None
    plot_path = args.plot or (None if args.smoke else PLOT)
    if plot_path:
        if losses1 is None:
            log(f"{first}/losses.json is missing: plotting phase 2 only")
            plot(None, losses2, plot_path)
        else:
            plot(losses1["vae"], losses1["denoiser"] + [(len(losses1["denoiser"]) + i, v) for i, v in losses2],
                 plot_path, restart=len(losses1["denoiser"]))
    log(f"done in {time.time() - t0:.0f} s: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

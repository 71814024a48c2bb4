"""Step caching at run time: the denoise loop over a bundle's split step graphs (qic/models/step_cache.py says
what each graph does; qic/host/cache_policy.py decides which rows compute)."""

from __future__ import annotations

import time

import torch

from qic.host.cache_policy import CacheSettings, RowState


def cached_loop(bundle, settings: CacheSettings, res, bucket, cfg: bool, batch: int, x, text, text_mask,
                schedule, steps: int, guidance: list, times: dict) -> tuple[torch.Tensor, list[RowState]]:
    """The denoise loop over the split graphs; returns (final latents, per row its state: the steps it
    computed and the figure of every step). Rows: the text rows (with CFG: the images' cond rows, then their
    uncond rows)."""
    head = bundle.graph("denoiser", res, bucket, cfg=cfg, batch=batch, part="head")
    mid = bundle.graph("denoiser", res, bucket, cfg=cfg, batch=batch, part="mid")
    tail = bundle.graph("denoiser", res, bucket, cfg=cfg, batch=batch, part="tail")
    rows = text.shape[0]
    mid_one = bundle.graph("denoiser", res, bucket, cfg=cfg, batch=batch, part="mid", rows=1) if rows > 1 else mid
    with_text = any(spec["name"] == "txt_base" for spec in tail.inputs)
    state = [RowState() for _ in range(rows)]
    prev = stored_img = stored_txt = None
    for i in range(steps):
        t0 = time.perf_counter()
        img, txt, temb, residual, diff = head(x, text, text_mask, schedule.timesteps[i],
                                              residual_like(prev, rows, head))
        figures = [None] * rows if settings.steps is not None else diff.tolist()  # the one device-to-host read
        compute = [state[r].decide(settings, i, figures[r]) for r in range(rows)]
        if getattr(bundle, "world", 1) > 1 and settings.steps is None:   # a static mask is the same on every rank
            # Every rank computes the same figures from the same (all-reduced) activations; rank 0's decisions
            # are sent anyway, because ranks that decided differently would wait in different collectives.
            sent = torch.tensor(compute, dtype=torch.uint8)
            torch.distributed.broadcast(sent, src=0, group=_decision_group())
            compute = [bool(c) for c in sent.tolist()]
        if all(compute):
            out_img, out_txt, res_img, res_txt = mid(img, txt, temb, text_mask)
        else:
            out_img, out_txt = img.clone(), txt.clone()
            res_img = torch.zeros_like(img) if stored_img is None else stored_img.clone()
            res_txt = torch.zeros_like(txt) if stored_txt is None else stored_txt.clone()
            for r in (r for r in range(rows) if compute[r]):
                o_i, o_t, r_i, r_t = mid_one(img[r:r + 1], txt[r:r + 1], temb[r:r + 1], text_mask[r:r + 1])
                out_img[r], out_txt[r], res_img[r], res_txt[r] = o_i[0], o_t[0], r_i[0], r_t[0]
        # Stored per row at its computed steps only; the tail gets (mid output, 0) for a computed row, which is
        # exact, and (head output, stored residual) for a cached one.
        mask = torch.tensor(compute).reshape(rows, 1, 1)
        stored_img, stored_txt = res_img, res_txt
        prev = residual if prev is None else torch.where(mask, residual, prev)
        img_base = torch.where(mask, out_img, img)
        img_res = torch.where(mask, torch.zeros_like(stored_img), stored_img)
        extra = []
        if with_text:
            extra = [text_mask, torch.where(mask, out_txt, txt), torch.where(mask, torch.zeros_like(stored_txt),
                                                                            stored_txt)]
        x = tail(x, img_base, img_res, temb, schedule.sigmas[i], schedule.sigmas[i + 1], *guidance, *extra)[0]
        times[f"step{i}"] = time.perf_counter() - t0
    return x, state


def residual_like(prev, rows: int, head) -> torch.Tensor:
    """The head's prev_residual input: the stored residuals, or ones before any step computed (the figure
    it yields is then ignored: a row's first step always computes)."""
    if prev is not None:
        return prev
    spec = next(s for s in head.inputs if s["name"] == "prev_residual")
    return torch.ones(rows, *spec["shape"][1:])


_GROUP = []


def _decision_group():
    """A process group of its own for the decisions: on the graphs' group, a broadcast between two graph calls
    left the next graph's collectives waiting (seen with gloo, torch 2.13). Made on first use, which every
    rank reaches at the same point (the first cached step)."""
    if not _GROUP:
        _GROUP.append(torch.distributed.new_group(backend="gloo"))
    return _GROUP[0]

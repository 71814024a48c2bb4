"""Step caching at run time: the denoise loop over a bundle's split step graphs (qic/models/step_cache.py says
what each graph does; qic/host/cache_policy.py decides which rows compute)."""

from __future__ import annotations

import time

import torch

from qic.host.cache_policy import CacheSettings, RowState
from qic.parallel.mesh import gather_figures


def cached_loop(bundle, settings: CacheSettings, res, bucket, cfg: bool, batch: int, x, text, text_mask,
                schedule, steps: int, guidance: list, times: dict) -> tuple[torch.Tensor, list[RowState]]:
    """The denoise loop over the split graphs; returns (final latents, per row its state: the steps it
    computed and the figure of every step). Rows: the text rows (with CFG: the images' cond rows, then their
    uncond rows). Under CFG-parallel this rank's graphs run its branch's rows only, but every rank keeps every
    row's state: the decisions are made from the figures of each branch's first rank, the same on all ranks."""
    head = bundle.graph("denoiser", res, bucket, cfg=cfg, batch=batch, part="head")
    mid = bundle.graph("denoiser", res, bucket, cfg=cfg, batch=batch, part="mid")
    tail = bundle.graph("denoiser", res, bucket, cfg=cfg, batch=batch, part="tail")
    rows = text.shape[0]
    split = bundle.layout.cfg > 1 and cfg
    local = rows // 2 if split else rows                # the rows this rank's mid and tail run
    mine = slice(bundle.coords["cfg"] * local, (bundle.coords["cfg"] + 1) * local) if split else slice(0, rows)
    local_mask = text_mask[mine]
    mid_one = bundle.graph("denoiser", res, bucket, cfg=cfg, batch=batch, part="mid", rows=1) if local > 1 else mid
    with_text = any(spec["name"] == "txt_base" for spec in tail.inputs)
    state = [RowState() for _ in range(rows)]
    prev = stored_img = stored_txt = None
    for i in range(steps):
        t0 = time.perf_counter()
        img, txt, temb, residual, diff = head(x, text, text_mask, schedule.timesteps[i],
                                              residual_like(prev, local, head))
        figures = decision_figures(bundle, settings, diff, split, rows)
        compute = [state[r].decide(settings, i, figures[r]) for r in range(rows)][mine]
        if all(compute):
            out_img, out_txt, res_img, res_txt = mid(img, txt, temb, local_mask)
        else:
            out_img, out_txt = img.clone(), txt.clone()
            res_img = torch.zeros_like(img) if stored_img is None else stored_img.clone()
            res_txt = torch.zeros_like(txt) if stored_txt is None else stored_txt.clone()
            for r in (r for r in range(local) if compute[r]):
                o_i, o_t, r_i, r_t = mid_one(img[r:r + 1], txt[r:r + 1], temb[r:r + 1], local_mask[r:r + 1])
                out_img[r], out_txt[r], res_img[r], res_txt[r] = o_i[0], o_t[0], r_i[0], r_t[0]
        # Stored per row at its computed steps only; the tail gets (mid output, 0) for a computed row, which is
        # exact, and (head output, stored residual) for a cached one.
        mask = torch.tensor(compute).reshape(local, 1, 1)
        stored_img, stored_txt = res_img, res_txt
        prev = residual if prev is None else torch.where(mask, residual, prev)
        img_base = torch.where(mask, out_img, img)
        img_res = torch.where(mask, torch.zeros_like(stored_img), stored_img)
        extra = []
        if with_text:
            extra = [local_mask, torch.where(mask, out_txt, txt),
                     torch.where(mask, torch.zeros_like(stored_txt), stored_txt)]
        x = tail(x, img_base, img_res, temb, schedule.sigmas[i], schedule.sigmas[i + 1], *guidance, *extra)[0]
        times[f"step{i}"] = time.perf_counter() - t0
    return x, state


def decision_figures(bundle, settings: CacheSettings, diff: torch.Tensor, split: bool, rows: int) -> list:
    """Every row's figure at this step, the same list on every rank (None each with a static mask: no read).
    With more ranks, each row's figure is that of the first rank (TP 0, Ulysses 0) of the CFG group that runs it:
    every rank computes the same figures from the same activations (TP: all-reduced; Ulysses: the sums span the
    sequence group), but ranks that decided differently would wait in different collectives, so one rank's
    figures decide for all. Under CFG-parallel the two branches' figures come from their own groups."""
    if settings.steps is not None:
        return [None] * rows
    local = diff.tolist()                               # the one device-to-host read of a step
    layout = bundle.layout
    if layout.world == 1:
        return local
    table = gather_figures("world" if split else "branch", local)
    if split:   # world ranks; each CFG group's first rank holds its branch's rows
        return [f for c in range(layout.cfg) for f in table[layout.rank_of(0, 0, c)].tolist()]
    return table[0].tolist()                            # this CFG group's first rank


def residual_like(prev, rows: int, head) -> torch.Tensor:
    """The head's prev_residual input: the stored residuals, or ones before any step computed (the figure
    it yields is then ignored: a row's first step always computes)."""
    if prev is not None:
        return prev
    spec = next(s for s in head.inputs if s["name"] == "prev_residual")
    return torch.ones(rows, *spec["shape"][1:])

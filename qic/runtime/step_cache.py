"""Step caching at run time: one denoise step over a bundle's split step graphs, for the one denoise loop
(qic/runtime/loop.py). qic/models/qwen_image/step_cache.py says what each graph does; qic/host/cache_policy.py decides
which rows compute, from the figures `decision_figures` reads (the one device-to-host read of a step)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from qic.errors import QicError
from qic.host.cache_policy import CacheSettings, RowState
from qic.parallel.mesh import gather_figures
from qic.runtime.protocol import Runnable


class RowDecisions:
    """Step caching's decision, as the cached step takes it: per step, from the head's figures, which of this
    rank's rows compute their middle blocks. Every rank keeps every row's state (the steps it computed and the
    figure of every step); `figures(diff)` gives every row's figure, the same list on every rank."""

    def __init__(self, settings: CacheSettings, rows: int, mine: slice, figures: Callable[[torch.Tensor], list]):
        self.settings, self.mine, self.figures = settings, mine, figures
        self.state = [RowState() for _ in range(rows)]

    def __call__(self, i: int, diff: torch.Tensor) -> list[bool]:
        figures = self.figures(diff)
        return [row.decide(self.settings, i, figures[r]) for r, row in enumerate(self.state)][self.mine]


class CachedStep:
    """One denoise step over the split graphs, a Step of the denoise loop: the head, then the rest (middle and
    tail in one graph) when every row computes, the tail when every row caches, the mixed graph (one row's middle
    and every row's tail) when one row computes and the others cache: two graph calls a step. Only where several
    rows compute and others cache (a batch's), the middle over each computing row, then the tail. Holds what
    carries from step to step (each row's last computed residuals). Rows: the text rows (with CFG: the images' cond
    rows, then their uncond rows); under CFG-parallel this rank's graphs run its branch's rows only (`mine`)."""

    def __init__(self, model: Runnable, res, bucket, cfg: bool, batch: int, text, text_mask, guidance: list,
                 decide: Callable[[int, torch.Tensor], list[bool]], mine: slice, bind=None):
        """bind: graph -> the graph over this batch's LoRA adapters (qic.runtime.lora; None: as loaded)."""
        def part(name: str, rows: int | None = None):
            graph = model.graph("denoiser", res, bucket, cfg=cfg, batch=batch, part=name, rows=rows)
            return graph if bind is None else bind(graph)

        def held(name: str, rows: int | None = None) -> bool:
            return model.has_graph("denoiser", res, bucket, cfg=cfg, batch=batch, part=name, rows=rows)
        if held("mid") and not held("rest"):
            raise QicError("this bundle's step-caching graphs are an earlier qic's (head, mid, tail; now head, rest, "
                           "mid@R1, tail): build it again, its other graphs come from the compile cache")
        self.head, self.rest, self.tail = part("head"), part("rest"), part("tail")
        self.local = mine.stop - mine.start                # the rows this rank's middle and tail run
        # Bundles built before the mixed graph hold the one-row middle for two rows too: the three-call path.
        self.mixed = part("mixed", rows=1) if held("mixed", rows=1) else None
        self.mid_one = part("mid", rows=1) if held("mid", rows=1) else None
        self.with_text = any(spec["name"] == "txt_base" for spec in self.tail.inputs)
        self.text, self.text_mask, self.local_mask = text, text_mask, text_mask[mine]
        self.guidance, self.decide = guidance, decide
        self.prev = self.stored_img = self.stored_txt = None

    def __call__(self, i: int, x, timestep, sigma, sigma_next):
        local, local_mask = self.local, self.local_mask
        img, txt, temb, residual, diff = self.head(x, self.text, self.text_mask, timestep,
                                                   residual_like(self.prev, local, self.head))
        compute = self.decide(i, diff)
        if all(compute):
            out, self.stored_img, self.stored_txt = self.rest(img, txt, temb, local_mask, x, sigma, sigma_next,
                                                              *self.guidance)
            self.prev = residual
            return out
        res_img = torch.zeros_like(img) if self.stored_img is None else self.stored_img.clone()
        res_txt = torch.zeros_like(txt) if self.stored_txt is None else self.stored_txt.clone()
        mask = torch.tensor(compute).reshape(local, 1, 1)
        self.prev = residual if self.prev is None else torch.where(mask, residual, self.prev)
        if sum(compute) == 1 and self.mixed is not None:
            r = compute.index(True)
            extra = [res_txt] if self.with_text else []
            out, r_img, r_txt = self.mixed(img, txt, temb, local_mask, x, res_img, torch.tensor([r]), sigma,
                                           sigma_next, *self.guidance, *extra)
            res_img[r], res_txt[r] = r_img[0], r_txt[0]
            self.stored_img, self.stored_txt = res_img, res_txt
            return out
        out_img, out_txt = img.clone(), txt.clone()
        for r in (r for r in range(local) if compute[r]):   # with several computing rows (mid_one exists)
            o_i, o_t, r_i, r_t = self.mid_one(img[r:r + 1], txt[r:r + 1], temb[r:r + 1], local_mask[r:r + 1])
            out_img[r], out_txt[r], res_img[r], res_txt[r] = o_i[0], o_t[0], r_i[0], r_t[0]
        # Stored per row at its computed steps only; the tail gets (mid output, 0) for a computed row, which is
        # exact, and (head output, stored residual) for a cached one.
        self.stored_img, self.stored_txt = res_img, res_txt
        img_base = torch.where(mask, out_img, img)
        img_res = torch.where(mask, torch.zeros_like(res_img), res_img)
        extra = []
        if self.with_text:
            extra = [local_mask, torch.where(mask, out_txt, txt),
                     torch.where(mask, torch.zeros_like(res_txt), res_txt)]
        return self.tail(x, img_base, img_res, temb, sigma, sigma_next, *self.guidance, *extra)[0]


def cached_step(model: Runnable, settings: CacheSettings, res, bucket, cfg: bool, batch: int, text, text_mask,
                guidance: list, bind=None) -> tuple[CachedStep, RowDecisions]:
    """The step-cached Step for these rows and the decisions it takes (whose `state` the run reports). Under
    CFG-parallel this rank's rows are its branch's; the decisions are made from the figures of each branch's
    first rank, the same on all ranks (decision_figures). bind: CachedStep's (the batch's LoRA adapters)."""
    rows = text.shape[0]
    split = model.layout.cfg > 1 and cfg
    local = rows // 2 if split else rows
    me = model.coords["cfg"]
    mine = slice(me * local, (me + 1) * local) if split else slice(0, rows)
    decide = RowDecisions(settings, rows, mine, lambda diff: decision_figures(model, settings, diff, split, rows))
    return CachedStep(model, res, bucket, cfg, batch, text, text_mask, guidance, decide, mine, bind), decide


def decision_figures(model: Runnable, settings: CacheSettings, diff: torch.Tensor, split: bool, rows: int) -> list:
    """Every row's figure at this step, the same list on every rank (None each with a static mask: no read).
    With more ranks, each row's figure is that of the first rank (TP 0, Ulysses 0) of the CFG group that runs it:
    every rank computes the same figures from the same activations (TP: all-reduced; Ulysses: the sums span the
    sequence group), but ranks that decided differently would wait in different collectives, so one rank's
    figures decide for all. Under CFG-parallel the two branches' figures come from their own groups."""
    if settings.steps is not None:
        return [None] * rows
    local = diff.tolist()                               # the one device-to-host read of a step
    layout = model.layout
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

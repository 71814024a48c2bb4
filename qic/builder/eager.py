"""The same graphs a bundle holds, run eagerly from a checkpoint: the reference path for checks.

`EagerModel` implements the runtime's interface of a loaded model (qic.runtime.protocol.Runnable: graph(),
has_graph(), tokenizer, settings, layout), with eager modules in place of compiled graphs and the same answers
a bundle built with the same keys gives, so compiled-vs-eager checks compare one thing only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from qic import family
from qic.builder.graphs import make_graph
from qic.checkpoint.reader import Checkpoint
from qic.dtypes import TORCH_DTYPES
from qic.errors import BundleError
from qic.graph_names import graph_name
from qic.host.latents import packed_grid
from qic.models.common import load_weights
from qic.parallel.mesh import RANK_INPUTS, Layout, join
from qic.parallel.tp import apply_tp, shard_state_dict
from qic.runtime.protocol import refuse_unlisted
from qic.spec import parse_spec
from qic.tokenizer import load_tokenizer


class _Eager:
    def __init__(self, gdef, fixed: dict | None = None):
        self.module = gdef.module.eval()
        self.examples = gdef.inputs   # (name, example tensor)
        # As a bundle's graph describes its inputs (qic.runtime.bundle.Graph), for the runtime's loops.
        self.inputs = [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype)} for n, t in gdef.inputs]
        self._dtypes = [t.dtype for _, t in gdef.inputs]
        self._fixed = {n: t for n, t in (fixed or {}).items() if n in {i["name"] for i in self.inputs}}

    def __call__(self, *tensors):
        given = iter(tensors)
        tensors = [self._fixed[i["name"]] if i["name"] in self._fixed else next(given) for i in self.inputs]
        args = [t.to(dt) for t, dt in zip(tensors, self._dtypes)]
        with torch.no_grad():
            out = self.module(*args)
        return list(out) if isinstance(out, tuple) else [out]


class EagerModel:
    def __init__(self, root: str | Path, resolutions, buckets, dtype: str = "float32",
                 step_cache: tuple[int, int] | None = None, layout: Layout | None = None, rank: int = 0,
                 cfg: tuple[bool, ...] = (True, False), batch_sizes: tuple[int, ...] | None = None):
        """layout, rank: run the denoiser as rank `rank` of a parallel layout (qic/parallel/mesh.py; the
        process group joined by the caller's spawner): its TP shard, the mesh's hooks and rank inputs. The
        text encoder and VAE stay whole (replicated).
        cfg, batch_sizes: the graphs this stand-in holds, as a bundle built with those keys would (the step
        graphs of each CFG mode; every graph at each batch size; None: any size), so the runtime takes the
        paths it takes on such a bundle. The defaults hold every graph, made on demand; the split graphs of
        step caching only with step_cache."""
        self.cfg_modes, self.batch_sizes = tuple(cfg), batch_sizes   # before `cfg` names a component's config
        self.ckpt = Checkpoint(Path(root))
        self.family = family.of_model_index(self.ckpt.root / "model_index.json")
        with family.using(self.family) as fam:   # its components: the stages'; none left in use after it
            self.tokenizer = load_tokenizer(self.ckpt.tokenizer_dir)
            self.resolutions = [tuple(r) for r in resolutions]
            self.buckets = list(buckets)
            # The host fields a bundle of these resolutions and buckets records, from the family's own hook (what its
            # host program reads: qic.runtime.programs), so one stand-in serves every family's program.
            given = {"model": str(self.ckpt.root), "resolutions": [f"{h}x{w}" for h, w in self.resolutions],
                     "text_buckets": self.buckets, "dtype": dtype}
            spec = parse_spec(given)
            self.manifest = self._host_fields(spec, fam)
            self.scheduler = self.manifest.get("scheduler")
            self.prompt = self.manifest.get("prompt")
            self.dtype = dtype
            self.configs, self.modules = {}, {}
            self.layout, self.rank = layout or Layout(), rank
            self.world, self.coords = self.layout.world, self.layout.coords(rank)
            join(self.layout)   # the mesh's groups and the host's (nothing on one rank)
            # the components a build of this checkpoint holds by default (a family's condition components only with
            # condition sizes: an edit checkpoint's defaults)
            built = {name: family.component(name) for name in spec.components}
            for name, comp in built.items():
                cfg = comp.parse_config(self.ckpt.config(comp.folder))
                sd = comp.convert(self.ckpt.weights(comp.folder).load())
                if comp.runs_layout and self.layout.tp > 1:
                    module = comp.make_module(cfg, tp_size=self.layout.tp)
                    sd = shard_state_dict(name, sd, self.coords["tp"], self.layout.tp)
                    apply_tp(module, self.layout.group_name("tp"))
                else:
                    module = comp.make_module(cfg)
                load_weights(module, sd, name)
                self.configs[name] = cfg
                self.modules[name] = module.to(TORCH_DTYPES[comp.run_dtype(dtype)]).eval()
            self.latents = self.manifest.get("latents")
            for h, w in self.resolutions:   # as `qic build` refuses them
                packed_grid(h, w, self.configs["vae_decoder"].scale_factor)
            # The parts of each component's graphs a build of these keys holds besides step caching's (None: the whole
            # graph; Qwen-Image-2.1's denoiser has only its prefill and decode)
            self._parts = {name: {shape.get("part") for shape in comp.graph_shapes(spec)}
                           for name, comp in built.items()}
            # step caching's split graphs, (part, rows), as the family's components plan them for a bundle
            self._split = set()
            if step_cache:
                split = parse_spec(given | {"step_cache": list(step_cache)})
                shapes = family.component("denoiser").graph_shapes(split)
                self._split = {(shape["part"], shape.get("rows")) for shape in shapes if "first" in shape}
            self._graphs = {}
            self.defaults = {}
            self.step_cache = dict(zip(("first", "last"), step_cache)) if step_cache else None
            self.lockstep = False   # each rank runs its own graphs eagerly

    @staticmethod
    def _host_fields(spec, fam) -> dict:
        """The family's manifest_fields for `spec` (qic.builder.bundle writes them into a bundle's manifest)."""
        from qic.builder.context import Context
        hook = getattr(family.components_module(fam), "manifest_fields", None)
        return hook(spec, Context(spec, None)) if hook is not None else {}

    def check_resolution(self, height: int, width: int) -> None:
        refuse_unlisted(height, width, self.resolutions, "eager model")

    def has_graph(self, component: str, resolution=None, bucket=None, cfg: bool = True, batch: int = 1,
                  part: str | None = None, rows: int | None = None) -> bool:
        """As a bundle of these resolutions, buckets, CFG modes, batch sizes and step_cache answers."""
        return self._holds(component, resolution, bucket, cfg, batch, part, rows)

    def _holds(self, component, resolution, bucket, cfg, batch, part, rows) -> bool:
        """has_graph, with the rows of step caching's split graphs over fewer rows (@R<rows>)."""
        return ((resolution is None or tuple(resolution) in self.resolutions)
                and (bucket is None or bucket in self.buckets)
                and (component != "denoiser" or cfg in self.cfg_modes)
                and (self.batch_sizes is None or batch in self.batch_sizes)
                and ((part in self._parts.get(component, {None}) and rows is None)
                     or (component == "denoiser" and (part, rows) in self._split)))

    def graph(self, component: str, resolution=None, bucket=None, cfg: bool = True, batch: int = 1,
              part: str | None = None, rows: int | None = None) -> _Eager:
        if not self._holds(component, resolution, bucket, cfg, batch, part, rows):   # as a bundle refuses it
            name = graph_name(component, resolution, bucket, cfg, batch, part, rows)
            raise BundleError(f"eager model: no graph {name} (it holds resolutions {self.resolutions}, buckets "
                              f"{self.buckets}, cfg {list(self.cfg_modes)}, batch sizes "
                              f"{list(self.batch_sizes or []) or 'any'}, step_cache {self.step_cache})")
        key = (component, resolution, bucket, cfg, batch, part, rows)
        if key not in self._graphs:
            with family.using(self.family):
                self._graphs[key] = self._make(component, resolution, bucket, cfg, batch, part, rows)
        return self._graphs[key]

    def _make(self, component, resolution, bucket, cfg, batch, part, rows) -> _Eager:
        # The shape as qic.builder.jobs plans it (absent entries: the defaults every graph maker assumes), made by the
        # component's own graph maker, as a build makes it.
        given = {"resolution": None if resolution is None else list(resolution), "bucket": bucket,
                 "cfg": None if cfg else False, "batch": None if batch == 1 else batch, "part": part, "rows": rows}
        split = self.step_cache if part not in self._parts.get(component, {None}) else None
        shape = {k: v for k, v in given.items() if v is not None} | (split or {})
        dtype = family.component(component).run_dtype(self.dtype)
        gdef = make_graph(component, self.modules[component], self.configs, shape, dtype, self.layout)
        fixed = {name: torch.tensor([self.coords[axis]]) for name, axis in RANK_INPUTS.items()}
        return _Eager(gdef, fixed)

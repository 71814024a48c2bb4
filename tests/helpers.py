"""Shared test helpers."""

from __future__ import annotations

import hashlib
import math
import shutil
import subprocess
import time
from pathlib import Path

import torch

EPS32 = torch.finfo(torch.float32).eps   # 2**-23; unit roundoff u = EPS32 / 2

# Image parity (tests.conftest.image_diff, 0..255 pixel units): two fp32 runs of the same arithmetic, reordered,
# differ by a few ulps before the 8-bit rounding, so a pixel moves by at most one level where a value sits at a
# rounding boundary, and such flips are rare: the max at most 2 levels and the mean at most 0.02 of a level (one
# value in 50 flipped). The mean bound is the one that catches a small error spread over every pixel, which the
# max bound (2) would let through; a wrong prompt, seed, mask or gather moves the mean by whole levels.
MAX_PIXEL, MEAN_PIXEL = 2, 0.02


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fp32_reorder_bound(k: int, reductions: int, safety: float = 4.0) -> float:
    """The rel-L2 by which two fp32 evaluations of the same math may differ when only the order of
    summation differs (matmul blocking changes with sequence length, vector width, thread count,
    fusion, a decomposition in export, a TP split).

    A length-k sum of sign-mixed terms, reordered, moves by about sqrt(k) * u relative to its size
    (k roundings of unit roundoff u = eps/2, random-walk); `reductions` such sums in sequence (each
    matmul, attention score and weighting, norm) add in quadrature. `safety` covers the non-random
    part of rounding and amplification by normalisations (softmax, RMSNorm). A wrong input or weight
    moves results by 1e-2 or more, hundreds of times this, so the bound still catches real errors.
    """
    return safety * (EPS32 / 2) * math.sqrt(k * reductions)


def sensitize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Re-draw a reference module's weights so outputs depend visibly on every weight.

    Default initialisations leave tiny random models nearly constant, which makes parity checks unable
    to fail. Matrices: normal(0, 2/sqrt(fan_in)); norm-like vectors (name ends in 'weight', 1-D):
    1 +- 0.1; other vectors: 0.1 * normal. Deterministic per tensor name.
    """
    with torch.no_grad():
        for name, p in module.state_dict().items():
            if not p.is_floating_point():
                continue
            g = torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:8], 16))
            if p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / fan_in ** 0.5))
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.1 * (2 * torch.rand(p.shape, generator=g) - 1))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return module


def text_encoder_bound(name: str) -> float:
    """fp32 reordering bound for a preset's text encoder: per layer six reductions (q/k/v, scores,
    weighting, output projection, gate/up, down), each at most max(hidden, intermediate) long.
    About 9e-6 for tiny and 1.3e-5 for tiny-alt."""
    from qic.checkpoint.presets import preset
    cfg = preset(name)["text_encoder"]
    return fp32_reorder_bound(max(cfg["hidden_size"], cfg["intermediate_size"]), 6 * cfg["num_hidden_layers"])


def mmdit_bound(name: str) -> float:
    """fp32 reordering bound for a preset's denoiser: per block about eight reductions (modulation,
    q/k/v, scores, weighting, output, MLP up and down), each at most the MLP width (4 x inner dim)
    long; plus the embeddings and the output layer. About 2.9e-5 for tiny."""
    from qic.checkpoint.presets import preset
    c = preset(name)["transformer"]
    return fp32_reorder_bound(4 * c["num_attention_heads"] * c["attention_head_dim"], 8 * c["num_layers"] + 4)


def assert_die_with(proc: subprocess.Popen, within: float = 10.0) -> list:
    """SIGKILL `proc`; every process under it (its ranks, multiprocessing's helper) must be gone `within`
    seconds (a zombie waiting for init to reap it holds nothing). Returns them."""
    import psutil
    below = psutil.Process(proc.pid).children(recursive=True)
    assert below, "nothing was running under the process"
    proc.kill()
    proc.wait(10)
    t = time.monotonic()
    _, alive = psutil.wait_procs(below, timeout=within)
    left = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except psutil.NoSuchProcess:
            pass
    assert not left, f"{[' '.join(p.cmdline())[:80] for p in left]} outlived their parent"
    print(f"{len(below)} processes under pid {proc.pid} gone {time.monotonic() - t:.2f} s after its SIGKILL")
    return below


def rewritten_bundle(src, dst, component: str | None = None, edit=None, manifest=None):
    """A FAKE other bundle: a copy of bundle `src` at `dst` whose `component` weight file is edit(its tensors)
    and/or whose manifest is manifest(its dict), re-hashed (file entry and id) so that it verifies and loads
    as a bundle of its own."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from qic.manifest import file_entry, finalize
    dst = Path(dst)
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    if edit is not None:   # every rank's file of a tensor-parallel component
        for rel in sorted({f for g in m["graphs"] if g["component"] == component for f in g["weights"]}):
            tensors = edit(load_file(str(dst / rel)))
            (dst / rel).unlink()   # a copy may share the session bundle's inode (hard links): never write through it
            save_file(tensors, str(dst / rel))
            m["files"][rel] = file_entry(dst, rel)
    m = manifest(m) if manifest is not None else m
    (dst / "manifest.json").write_text(json.dumps(finalize({k: v for k, v in m.items() if k != "id"})))
    return dst


def outputs_on_collective_buffers(package) -> list[str]:
    """The outputs of an AOTInductor package (its generated wrapper.cpp) that are, or reuse, a buffer a functional
    collective read or wrote (a _c10d_functional call, or a proxy-executor call under the comment naming one): what
    qic's collective graph configs rule out (qic/backends/inductor/build.py)."""
    import re
    import zipfile
    with zipfile.ZipFile(package) as z:
        src = next(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    reused = dict(re.findall(r"auto (\w*buf\d+) = std::move\((\w*buf\d+)\);\s*// reuse", src))

    def root(buf):
        while buf in reused:
            buf = reused[buf]
        return buf
    touched, in_collective = set(), False
    for line in src.splitlines():
        line = line.strip()
        if line.startswith("//") and "Source Nodes" in line:
            in_collective = "_c10d_functional" in line
        elif "aoti_torch_cpu__c10d_functional_" in line or (in_collective and "proxy_executor_call_function" in line):
            # a collective called directly, or through the proxy executor (all_gather_into_tensor here)
            touched |= {root(b) for b in re.findall(r"\b(\w*buf\d+)\b", line)}
    return [f"output {i} = {b}" for i, b in re.findall(r"output_handles\[(\d+)\] = (\w*buf\d+)", src)
            if root(b) in touched]


def one_line_refusal(proc, *needles):
    """A refused CLI call as qic's one error path makes it (issue 19's finding 10): exit 2, no traceback, one
    `error:` line (any further lines are `fix:` hints), naming each of `needles`."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and all(x.startswith("  fix: ") for x in lines[1:]), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


class DecodePrefix:
    """A loaded bundle whose decode graph (2.1's `part="decode"` or `"decode-images"`) is handed `prefix(k, v)` in
    place of the host's resident prefix K/V: a broken variant's prefix (another prompt's, another rank's); everything
    else is the bundle's."""

    def __init__(self, inner, prefix):
        self.inner, self.prefix = inner, prefix

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def graph(self, component, *args, part=None, **kw):
        g = self.inner.graph(component, *args, part=part, **kw)
        if part not in ("decode", "decode-images"):
            return g
        return lambda target, ts, k, v, *rest: g(target, ts, *self.prefix(k, v), *rest)


def scheduler_at_step(seq_len: int, steps: int = 6, i: int = 2):
    """(FlowMatchEulerDiscreteScheduler of the tiny preset set for `steps` steps at an image of seq_len tokens,
    begun at step i, i): where a test takes one pipeline step to compare a denoise step graph with."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from qic.checkpoint.presets import preset
    sched = FlowMatchEulerDiscreteScheduler.from_config(preset("tiny")["scheduler"])
    c = sched.config
    mu = calculate_shift(seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    sched.set_begin_index(i)
    return sched, i


def images_only_processor(processor_class, proc_dir):
    """transformers' own Qwen-VL processor (`processor_class`: Qwen2VLProcessor, Qwen3VLProcessor) over a checkpoint's
    processor files, its image part the PIL class the folder's preprocessor_config.json describes and no video part:
    a processor's parts are what ProcessorMixin.get_attributes lists, so that list leaves video_processor out while
    it is made (../shared/notes/qwen-image.md: the video processor needs torchvision, which this environment lacks).
    Text, image pads, pixel values and grids are then the real processor's, which a stand-in could not vouch for."""
    import json
    from pathlib import Path
    from unittest import mock

    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc_dir = Path(proc_dir)
    settings = json.loads((proc_dir / "preprocessor_config.json").read_text())
    image_processor = Qwen2VLImageProcessorPil(**{k: v for k, v in settings.items() if k != "image_processor_type"})
    tokenizer = transformers.AutoTokenizer.from_pretrained(proc_dir)
    parts = [a for a in processor_class.get_attributes() if a != "video_processor"]
    with mock.patch.object(processor_class, "get_attributes", classmethod(lambda _: parts)):
        return processor_class(image_processor=image_processor, tokenizer=tokenizer,
                               chat_template=(proc_dir / "chat_template.jinja").read_text())


def scaled_checkpoint(src: Path, dst: Path, factor: float) -> Path:
    """A copy of a checkpoint with its transformer's and text encoder's matrices (not the token embedding) scaled by
    `factor`: the sensitized draw (sensitize_) made gentle enough that one bf16 forward is a small relative error, as
    in a real model, for the bf16 fidelity checks."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    for folder in ("transformer", "text_encoder"):
        for f in (dst / folder).glob("*.safetensors"):
            sd = load_file(str(f))
            save_file({k: v * factor if v.dim() >= 2 and "embed_tokens" not in k else v for k, v in sd.items()},
                      str(f), metadata={"format": "pt"})
    return dst


MEMO = "qic_test_references"   # set to {} on a module fixture's pipeline whose weights the tests never change


def memoised(pipe, key: tuple, draw):
    """draw() (a reference image) once for each key on a pipeline that carries a memo (MEMO), every time on any
    other; a copy each time, as callers may change what they get."""
    memo = getattr(pipe, MEMO, None)
    if memo is None:
        return draw()
    if key not in memo:
        memo[key] = draw()
    return memo[key].copy()


def picture_key(*images) -> tuple:
    """PIL images as a memo key: their sizes, modes and pixels."""
    return tuple((im.size, im.mode, im.tobytes()) for im in images)


def check_previews(run) -> None:
    """A host program's previews (qic.runtime.loop; qic serve's partial images): run(previews) runs the program with
    the hook and returns its Result. The hook is called after every step, in order, with the run's step count; the
    last step's predicted picture is the result's image (x0 read from the last update is the final latents, up to
    the subtraction's rounding: the image parity bound), and the first step's is far from it (mean > 1 level), so
    the check can tell a preview from the image."""
    import numpy as np
    seen = []
    result = run(lambda step, steps, decode: seen.append((step, steps, decode([0])[0])))
    steps = seen[0][1]
    assert [(s, n) for s, n, _ in seen] == [(i, steps) for i in range(steps)], [(s, n) for s, n, _ in seen]

    def diff(a, b):
        d = np.abs(np.asarray(a).astype(np.float64) - np.asarray(b).astype(np.float64))
        return float(d.max()), float(d.mean())
    worst, mean = diff(seen[-1][2], result.image)
    assert worst <= MAX_PIXEL and mean <= MEAN_PIXEL, (worst, mean)
    assert diff(seen[0][2], result.image)[1] > 1

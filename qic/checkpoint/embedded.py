"""The embedded checkpoints: tiny Qwen-Images in the real hub/diffusers layout, random (the parity tests'
presets) or trained (`shapes`, the default: weights from package data, qic/checkpoint/trained.py).

`write_checkpoint(out_dir, preset_name, seed)` writes, deterministically and atomically, a directory that
`diffusers.QwenImagePipeline.from_pretrained` loads as is, laid out like `Qwen/Qwen-Image` on the hub:

    model_index.json
    scheduler/scheduler_config.json
    tokenizer/      vocab.json, merges.txt, tokenizer_config.json, added_tokens.json,
                    special_tokens_map.json, chat_template.jinja, tokenizer.json (optional)
    text_encoder/   config.json, model-0000N-of-0000M.safetensors, model.safetensors.index.json
    transformer/    config.json, diffusion_pytorch_model-0000N-of-0000M.safetensors, ...index.json
    vae/            config.json, diffusion_pytorch_model.safetensors
    .qic-embedded.json   (marker: preset, seed, generator version, file sizes; written last)

`write_checkpoint_from_configs(out_dir, configs, label)` writes the same for other component configs (the
real-width benchmark's: the real Qwen-Image configs at reduced depth, benchmarks.realwidth).

Only qic code, torch, safetensors and tokenizers are used (diffusers/transformers are test-only).

Tokenizer: byte-level BPE trained by `train_bpe` (below, pure Python, deterministic) on the fixed built-in
English corpus `CORPUS`: 256 byte tokens (GPT-2/Qwen byte order) + merges up to presets.TOKENIZER_REGULAR
ordinary tokens, then Qwen's special tokens at the ids presets.py gives. It does not depend on the seed.

Weights (float32), each tensor drawn from its own generator seeded by sha256(f"{seed}:{component}:{name}"),
so a tensor does not depend on which other tensors exist or their order:
  * matrices and conv kernels (dim >= 2): normal(0, 2/sqrt(fan_in)), fan_in = numel of one output slice;
  * norm scales (1-D '...weight', and every '...gamma', whose shape in the VAE is (C,1,1[,1])): 1 +- 0.1;
  * other vectors (biases): 0.1 * normal.
Default initialisations make a tiny model's image nearly independent of prompt and guidance; this recipe
makes it depend on them visibly (docs: /work/shared/notes/qwen-image.md, "make the check able to fail").

VAE output spread: the decoder's last conv (decoder.conv_out) sees norm_out's unit-RMS features through
SiLU, so its kernel scale alone sets the pixel spread, whatever the scale of the residual stream before
it. With the raw recipe, decoded random latents (z * std + mean, z ~ N(0,1)) have std ~0.57 in
[-1, 1] units with ~13% of values clipped at -1/1 (~16% of pixels at 0/255 in a 3-step pipeline image).
Scaling that one kernel by 0.7 (`VAE_KERNEL_SCALE`) gives std ~0.45 and ~4-5% clipped, while keeping the
image clearly sensitive to prompt and guidance (measured in tests/test_embedded_checkpoint.py). Damping
the residual-branch convs (conv1/conv2 by 0.7) was tried and leaves the spread unchanged (std 0.570).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from qic.checkpoint import presets as _presets
from qic.checkpoint.tensor_names import text_encoder_tensors, transformer_tensors, vae_tensors
from qic.errors import CheckpointError
from qic.tokenizer import (
    QWEN2_PRETOKENIZE_REGEX,
    added_token_entry,
    tokenizer_json_dict,
)

GENERATOR_VERSION = 1
MARKER_NAME = ".qic-embedded.json"
SAFETENSORS_METADATA = {"format": "pt"}

# Multipliers on the recipe's normal(0, 2/sqrt(fan_in)) for VAE conv kernels, by the tensor's name suffix
# (first match wins). See the module docstring. Biases and norm scales are not scaled.
VAE_KERNEL_SCALE: tuple[tuple[str, float], ...] = (
    ("decoder.conv_out.weight", 0.7),
)

MODEL_INDEX = {
    "_class_name": _presets.PIPELINE_CLASS,
    "_diffusers_version": "0.34.0.dev0",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}

# An edit preset's processor folder (the Edit checkpoints' processor/): Qwen2.5-VL's published preprocessor_config.json
# (Qwen/Qwen-Image-Edit-2509's), beside the tokenizer files and the chat template.
PREPROCESSOR_CONFIG = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
                       "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                       "image_std": [0.26862954, 0.26130258, 0.27577711], "min_pixels": 3136,
                       "max_pixels": 12845056}
# model_index.json's record of a model's own condition-image areas (pixels; qic.spec.condition_areas reads it).
# diffusers' pipelines ignore keys that start with "_" and resize to their module constants (VAE_IMAGE_SIZE,
# CONDITION_IMAGE_SIZE), so a diffusers user of such a model patches those two.
CONDITION_AREAS_KEY = "_qic_condition_areas"


def model_index(p: Mapping) -> dict:
    """model_index.json of a preset: QwenImagePipeline's, or for an edit preset (`edit`: its pipeline class and
    condition areas) that pipeline's, with a processor."""
    edit = p.get("edit")
    if not edit:
        return dict(MODEL_INDEX)
    return MODEL_INDEX | {"_class_name": edit["pipeline"], "processor": ["transformers", "Qwen2VLProcessor"],
                          CONDITION_AREAS_KEY: dict(edit["areas"])}


CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)

# Fixed training text for the embedded BPE: original plain English about pictures (what prompts talk about).
CORPUS = """\
A photograph of a small red house standing at the edge of a green field under a wide blue sky. The roof is
dark grey, the door is painted yellow, and two round windows look out over the grass. A narrow path of flat
white stones leads from the gate to the door. In the background there are three tall trees and a low hill.
A close-up image of a cat sleeping on a soft blue blanket. The cat has orange fur with white paws, long
whiskers and closed eyes. Light from a window falls across the blanket and makes the fur look warm and bright.
A busy city street at night, with bright shop signs, wet roads reflecting the lights, cars waiting at a red
traffic light, and people walking under black umbrellas. The text on the largest sign reads "OPEN 24 HOURS".
A bowl of fresh fruit on a wooden kitchen table: four green apples, a bunch of yellow bananas, two oranges
and a handful of purple grapes. The table has a rough texture, and a white cup of coffee stands to the left
of the bowl. The background is a plain white wall with a small painting of the sea.
A mountain lake in the early morning. The water is calm and clear, the mountains are covered with snow, and
a thin layer of mist floats above the surface. A red boat is tied to a wooden dock in the foreground.
A poster with bold black letters on an orange background. The title says "SUMMER MUSIC FESTIVAL 2025" and
below it, in smaller white text, the dates "July 12 - July 14" and the words "three days, forty bands, one
park". The letters are large, the shapes are simple, and the colors are strong.
A portrait of an old man with a grey beard and kind brown eyes, wearing a blue wool hat and a dark green
coat. He is smiling and holding a cup of tea in both hands. The light is soft and the background is blurred.
An illustration of a dragon flying over a castle. The dragon is long and thin, with shining gold scales,
wide wings and a curled tail. The castle has four towers, each with a pointed red roof and a small flag.
A flat vector icon of a rocket: a white body, a round blue window, red fins and an orange flame at the
bottom, on a dark purple circle. The design is clean and minimal, with smooth edges and no shadows.
A beach at sunset, with pink and orange clouds, soft waves on the sand, a row of palm trees on the right
side, and two children building a sand castle near the water. The sun is a bright circle on the horizon.
A still life of glass bottles of different sizes and colors: a tall green bottle, a short brown bottle, a
round blue bottle and a thin clear bottle. They stand in a line on a shelf and cast colored shadows.
A street market with many small stalls selling vegetables, flowers, bread and cheese. Tomatoes are piled in
red heaps, the flowers are white, yellow and pink, and the bread is golden brown. A woman in a striped
shirt is paying at the front stall, and a dog sits quietly next to her.
A top-down view of a desk with a laptop, a notebook, two pencils, a pair of glasses and a green plant in a
square pot. The desk surface is light grey and the objects are arranged neatly with space between them.
A snowy forest path in winter. Tall dark trees stand on both sides, the snow is deep and white, and a
small fox with a bushy tail walks across the path. Footprints lead away into the trees.
A sign on a brick wall that reads "Welcome to the Coffee Corner", in curly white letters on a black board,
with a drawing of a steaming cup. Below it, a chalk menu lists prices: coffee 3.50, tea 2.75, cake 4.00.
A robot made of shiny metal parts, standing in a workshop full of tools. It has a square head, two round
eyes that glow blue, long arms with three fingers on each hand, and wheels instead of feet.
A field of sunflowers stretching to the horizon under a clear sky. Each flower is large and bright yellow
with a dark center, and the tall stems lean toward the sun. A single white cloud floats above the field.
A cozy living room with a grey sofa, a round wooden coffee table, a striped rug, a tall lamp, a bookshelf
full of colorful books, and a large window showing a garden. A black and white dog lies on the rug.
A bird sitting on a thin branch, with bright blue feathers on its back, an orange chest and a short black
beak. The branch has small green leaves and white flowers, and the background is a soft green blur.
An aerial photo of a river winding through farmland, with square fields in many shades of green and brown,
small white farm houses, and a long straight road crossing a stone bridge over the water.
A child's drawing of a family: four stick figures holding hands in front of a house, a big yellow sun with
lines for rays in the corner, a blue line for the sky, and green scribbles for the grass.
A plate of food in a restaurant: a piece of grilled fish, a small pile of rice, sliced carrots, green beans
and a lemon wedge, on a square white plate. A glass of water and a folded napkin sit beside the plate.
A train crossing a tall stone bridge in the mountains, with white steam rising from the engine and eight
red carriages following behind. Below the bridge, a fast river runs between large grey rocks.
A neon sign in the shape of a heart, glowing pink and purple against a dark wall, with the word "LOVE"
written inside it in thin bright letters. The reflection of the light shows on the shiny floor.
An old map of an island, drawn in brown ink on yellow paper, with mountains, forests, a small town, a ship
near the coast, a compass in the corner, and a red cross marking the place of hidden treasure.
Describe the scene in detail: the color of each object, its shape and size, the texture of its surface, the
quantity of similar objects, any text that is visible, and the spatial relationships between the objects
and the background. Objects in the front are larger; objects in the back are smaller and less detailed.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 16 20 24 32 48 64 100 128 256 512 1000 1024 2048 2025 3.14 50%.
Punctuation: commas, periods. Questions? Exclamations! Quotes "like this" and 'like this'. A list: one;
two; three. Brackets (round), [square] and {curly}. Symbols: + - * / = < > # @ & $ % ^ ~ _ | \\ ` : ...
"""


# --------------------------------------------------------------------------------------------------------
# Tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/Qwen byte -> printable character map; its order (printable bytes first) is the id order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_bpe(text: str, vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Deterministic byte-level BPE on `text` until the vocabulary has `vocab_size` ordinary tokens.

    Pre-tokenisation is Qwen2's (NFC, split regex, ByteLevel). The most frequent adjacent pair is merged
    each round; ties go to the lexicographically smallest pair. Ids: 256 byte tokens, then merge results.
    """
    from tokenizers import Regex, normalizers, pre_tokenizers

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    words = Counter(w for w, _ in pre.pre_tokenize_str(normalizers.NFC().normalize_str(text)))
    byte_chars = list(bytes_to_unicode().values())
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    segs = {w: list(w) for w in words}

    pair_count: Counter = Counter()
    pair_words: dict[tuple[str, str], set[str]] = {}
    for w, c in words.items():
        s = segs[w]
        for p in zip(s, s[1:]):
            pair_count[p] += c
            pair_words.setdefault(p, set()).add(w)

    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        live = [(c, p) for p, c in pair_count.items() if c > 0]
        if not live:
            raise RuntimeError(f"BPE corpus too small for {vocab_size} tokens (stopped at {len(vocab)})")
        best_c = max(c for c, _ in live)
        best = min(p for c, p in live if c == best_c)
        merges.append(best)
        new = best[0] + best[1]
        if new not in vocab:
            vocab[new] = len(vocab)
        for w in sorted(pair_words.get(best, ())):
            s, c = segs[w], words[w]
            for p in zip(s, s[1:]):
                pair_count[p] -= c
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == best[0] and s[i + 1] == best[1]:
                    out.append(new)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            segs[w] = out
            for p in zip(out, out[1:]):
                pair_count[p] += c
                pair_words.setdefault(p, set()).add(w)
        pair_words.pop(best, None)
        pair_count.pop(best, None)
    return vocab, merges


def _special_tokens() -> list[tuple[int, str]]:
    return [(_presets.special_id(t), t) for t in _presets.SPECIAL_TOKENS]


def tokenizer_files(tokenizer_json: bool = True) -> dict[str, bytes]:
    """File name -> content of the embedded tokenizer directory (the real Qwen2Tokenizer file set)."""
    vocab, merges = train_bpe(CORPUS, _presets.TOKENIZER_REGULAR)
    if len(vocab) != _presets.TOKENIZER_REGULAR:  # pragma: no cover - guarded by train_bpe
        raise AssertionError(len(vocab))
    specials = _special_tokens()
    added = [added_token_entry(i, t, True) for i, t in specials]
    flag = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    eos, pad = "<|im_end|>", "<|endoftext|>"
    additional = [t for _, t in specials if t != pad]
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": t, **flag, "special": True} for i, t in specials},
        "additional_special_tokens": additional,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "extra_special_tokens": {},
        "model_max_length": 131072,
        "pad_token": pad,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    files = {
        "vocab.json": _json_bytes(vocab, sort_keys=False, indent=None),
        "merges.txt": ("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)).encode("utf-8"),
        "tokenizer_config.json": _json_bytes(config),
        "added_tokens.json": _json_bytes({t: i for i, t in specials}),
        "special_tokens_map.json": _json_bytes({
            "additional_special_tokens": additional,
            "eos_token": {"content": eos, **flag},
            "pad_token": {"content": pad, **flag},
        }),
        "chat_template.jinja": CHAT_TEMPLATE.encode("utf-8"),
    }
    if tokenizer_json:
        files["tokenizer.json"] = _json_bytes(tokenizer_json_dict(vocab, merges, added), sort_keys=False)
    return files


# --------------------------------------------------------------------------------------------------------
# Weights


def _tensor_seed(seed: int, component: str, name: str) -> int:
    """torch.Generator seed of one tensor: the first 60 bits of sha256(f"{seed}:{component}:{name}")."""
    return int(hashlib.sha256(f"{seed}:{component}:{name}".encode()).hexdigest()[:15], 16)


def _vae_scale(name: str) -> float:
    for suffix, s in VAE_KERNEL_SCALE:
        if name.endswith(suffix):
            return s
    return 1.0


def draw_tensor(seed: int, component: str, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One tensor of the recipe in the module docstring (float32, contiguous)."""
    g = torch.Generator().manual_seed(_tensor_seed(seed, component, name))
    shape = tuple(shape)
    if name.endswith("gamma") or (len(shape) == 1 and name.endswith("weight")):
        return 1.0 + 0.1 * (2.0 * torch.rand(shape, generator=g) - 1.0)
    if len(shape) >= 2:
        fan_in = math.prod(shape[1:])
        scale = 2.0 / math.sqrt(fan_in)
        if component == "vae":
            scale *= _vae_scale(name)
        return torch.randn(shape, generator=g) * scale
    return 0.1 * torch.randn(shape, generator=g)


def component_state_dict(component: str, config: Mapping, seed: int) -> dict[str, torch.Tensor]:
    enumerate_fn = {"transformer": transformer_tensors, "vae": vae_tensors,
                    "text_encoder": text_encoder_tensors}[component]
    return {n: draw_tensor(seed, component, n, s) for n, s in enumerate_fn(config)}


def _shard(names_sizes: list[tuple[str, int]], n_shards: int) -> list[list[str]]:
    """Split an ordered list into n contiguous groups of roughly equal byte size (n groups when possible)."""
    total = sum(s for _, s in names_sizes)
    shards: list[list[str]] = [[] for _ in range(n_shards)]
    acc = 0
    for name, size in names_sizes:
        k = min(n_shards - 1, int(acc * n_shards / total)) if total else 0
        shards[k].append(name)
        acc += size
    shards = [s for s in shards if s]
    if len(shards) < n_shards <= len(names_sizes):  # one tensor dominates: split by count instead
        per = math.ceil(len(names_sizes) / n_shards)
        names = [n for n, _ in names_sizes]
        shards = [names[i:i + per] for i in range(0, len(names), per)]
    return shards


def _write_sharded(dirpath: Path, sd: Mapping[str, torch.Tensor], stem: str, n_shards: int) -> None:
    """`{stem}-0000N-of-0000M.safetensors` + `{stem}.safetensors.index.json` (transformers/diffusers form)."""
    groups = _shard([(n, t.numel() * t.element_size()) for n, t in sd.items()], n_shards)
    weight_map = {}
    for k, names in enumerate(groups, 1):
        fname = f"{stem}-{k:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: sd[n] for n in names}, str(dirpath / fname), metadata=dict(SAFETENSORS_METADATA))
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (dirpath / f"{stem}.safetensors.index.json").write_bytes(
        _json_bytes({"metadata": {"total_size": total}, "weight_map": weight_map}))


# --------------------------------------------------------------------------------------------------------
# The checkpoint


def _json_bytes(obj, sort_keys: bool = True, indent: int | None = 2) -> bytes:
    return (json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False) + "\n").encode("utf-8")


def _marker(preset_name: str, seed: int, tokenizer_json: bool) -> dict:
    return {"generator": "qic.checkpoint.embedded", "generator_version": GENERATOR_VERSION,
            "preset": preset_name, "seed": int(seed), "tokenizer_json": bool(tokenizer_json)}


# Safetensors files per sharded component (the embedded presets: 2 each, so the index files are exercised).
DEFAULT_SHARDS = {"text_encoder": 2, "transformer": 2}


def _generate(root: Path, p: Mapping, marker: dict, seed: int, tokenizer_json: bool,
              shards: Mapping[str, int] = DEFAULT_SHARDS, weights=None) -> None:
    """Write the checkpoint of the component configs `p` (text_encoder, transformer, vae, scheduler) into
    root. Components are drawn (or, with `weights(component)`, read) and written one after another, so at
    most one is in memory."""
    def state(component: str) -> dict[str, torch.Tensor]:
        return weights(component) if weights else component_state_dict(component, p[component], seed)

    (root / "model_index.json").write_bytes(_json_bytes(model_index(p)))

    d = root / "scheduler"
    d.mkdir()
    (d / "scheduler_config.json").write_bytes(_json_bytes(p["scheduler"]))

    d = root / "tokenizer"
    d.mkdir()
    for name, data in tokenizer_files(tokenizer_json).items():
        (d / name).write_bytes(data)

    if p.get("edit"):
        d = root / "processor"
        d.mkdir()
        for name, data in tokenizer_files(tokenizer_json).items():
            (d / name).write_bytes(data)
        (d / "preprocessor_config.json").write_bytes(_json_bytes(PREPROCESSOR_CONFIG))

    d = root / "text_encoder"
    d.mkdir()
    (d / "config.json").write_bytes(_json_bytes(p["text_encoder"]))
    _write_sharded(d, state("text_encoder"), "model", shards["text_encoder"])

    d = root / "transformer"
    d.mkdir()
    (d / "config.json").write_bytes(_json_bytes(p["transformer"]))
    _write_sharded(d, state("transformer"), "diffusion_pytorch_model",
                   shards["transformer"])

    d = root / "vae"
    d.mkdir()
    (d / "config.json").write_bytes(_json_bytes(p["vae"]))
    save_file(state("vae"), str(d / "diffusion_pytorch_model.safetensors"),
              metadata=dict(SAFETENSORS_METADATA))

    files = sorted(f for f in root.rglob("*") if f.is_file())
    marker = dict(marker)
    marker["files"] = {f.relative_to(root).as_posix(): f.stat().st_size for f in files}
    (root / MARKER_NAME).write_bytes(_json_bytes(marker))


def read_marker(out_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(out_dir) / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_complete(out_dir: str | Path, preset_name: str = "tiny", seed: int = 0, tokenizer_json: bool = True) -> bool:
    """True when out_dir holds this generator's checkpoint for these arguments, every file present and sized."""
    return _matches(Path(out_dir), _marker(preset_name, seed, tokenizer_json))


def _matches(root: Path, expected: dict) -> bool:
    m = read_marker(root)
    if not isinstance(m, dict) or not isinstance(m.get("files"), dict):
        return False
    if {k: m.get(k) for k in expected} != expected:
        return False
    for rel, size in m["files"].items():
        f = root / rel
        try:
            if f.stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def write_checkpoint(out_dir: str | Path, preset_name: str = "tiny", seed: int = 0, *,
                     tokenizer_json: bool = True) -> Path:
    """Write (or reuse) the embedded tiny checkpoint at out_dir; returns its path.

    Reuses out_dir when it already holds a complete checkpoint of the same preset, seed, tokenizer form
    and generator version. Otherwise generates into a temporary directory beside out_dir and renames it
    into place, so readers never see a half-written checkpoint. An out_dir that exists but was not written
    by this generator (no marker) and is not empty is refused rather than overwritten.
    """
    if preset_name not in _presets.PRESETS:
        raise CheckpointError(f"unknown embedded checkpoint preset {preset_name!r}",
                              f"known: {', '.join(sorted(_presets.PRESETS))}")
    p = _presets.preset(preset_name)
    marker = _marker(preset_name, seed, tokenizer_json)
    weights = None
    if p.get("trained"):   # the trained model's weights are package data: the seed does not enter
        from qic.checkpoint import trained
        marker["weights_sha256"] = trained.weights_digest(preset_name)
        weights = lambda component: trained.state_dict(preset_name, component)   # noqa: E731
    return _write(Path(out_dir), p, marker, seed, tokenizer_json, DEFAULT_SHARDS, weights)


def write_checkpoint_from_configs(out_dir: str | Path, configs: Mapping, label: str, seed: int = 0, *,
                                  shards: Mapping[str, int] = DEFAULT_SHARDS, weights=None) -> Path:
    """Like write_checkpoint, for given component configs (keys text_encoder, transformer, vae, scheduler, and
    `edit` for an edit model; e.g. the real Qwen-Image's at reduced depth): the same recipe, tokenizer and layout,
    or `weights(component)`'s state dicts (then `label` must name them: it is what the reuse check keys on). Reused
    when the directory holds this generator's checkpoint of the same configs (by digest), label and seed."""
    digest = hashlib.sha256(json.dumps(configs, sort_keys=True).encode()).hexdigest()
    marker = _marker(label, seed, True) | {"configs_sha256": digest}
    return _write(Path(out_dir), configs, marker, seed, True, shards, weights)


def _write(out_dir: Path, configs: Mapping, marker: dict, seed: int, tokenizer_json: bool,
           shards: Mapping[str, int], weights=None) -> Path:
    out = out_dir.absolute()
    if _matches(out, marker):
        return out
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.is_dir() and read_marker(out) is None and any(out.iterdir()):
        raise CheckpointError(f"{out} exists, is not empty and is not an embedded qic checkpoint",
                              "choose another directory or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _generate(tmp, configs, marker, seed, tokenizer_json, shards, weights)
        for f in tmp.rglob("*"):  # mkdtemp makes 0700, safetensors may write 0600: make it readable
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        _install(tmp, out, marker)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _install(tmp: Path, out: Path, marker: dict) -> None:
    """Rename tmp to out; a stale or different embedded checkpoint (or empty dir) at out is replaced."""
    for _ in range(3):
        try:
            os.rename(tmp, out)  # atomic; fails if out is a non-empty directory
            return
        except OSError:
            if _matches(out, marker):
                return  # another process won the race with the same content
            if not out.exists():
                continue
            if read_marker(out) is None and out.is_dir() and any(out.iterdir()):
                raise CheckpointError(f"{out} appeared meanwhile and is not an embedded qic checkpoint")
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            try:
                os.rename(out, old / "ckpt")
            except OSError:
                shutil.rmtree(old, ignore_errors=True)
                continue
            shutil.rmtree(old, ignore_errors=True)
    raise CheckpointError(f"could not move the generated checkpoint into {out}")

"""Loading the Qwen2 byte-level BPE tokenizer of a Qwen-Image checkpoint.

Imported by the runtime: stdlib + `tokenizers` only (no torch, no transformers).

A checkpoint's tokenizer/ directory comes in two forms: with a `tokenizer.json` (the `tokenizers`
serialisation), or only with the slow-tokenizer files `vocab.json` + `merges.txt` + `tokenizer_config.json`
(the real `Qwen/Qwen-Image` repo ships added_tokens.json, merges.txt, special_tokens_map.json,
tokenizer_config.json, vocab.json and a chat template). `load_tokenizer` reads either and yields the same
`tokenizers.Tokenizer` that transformers' Qwen2Tokenizer builds: NFC normaliser, Qwen2's split regex,
ByteLevel without prefix space, byte-level decoder, the added (special) tokens at their own ids, and no
BOS/EOS added on encode.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from qic.errors import CheckpointError
from qic.host.prompt import TEMPLATE

QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501 (the regex whole)
)

TOKENIZER_JSON = "tokenizer.json"
VOCAB_JSON = "vocab.json"
MERGES_TXT = "merges.txt"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
ADDED_TOKENS_JSON = "added_tokens.json"

_BYTE_LEVEL = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def added_token_entry(token_id: int, content: str, special: bool = True, *, lstrip: bool = False,
                      rstrip: bool = False, single_word: bool = False, normalized: bool = False) -> dict:
    """One entry of tokenizer.json's "added_tokens" list."""
    return {"id": int(token_id), "content": content, "single_word": bool(single_word), "lstrip": bool(lstrip),
            "rstrip": bool(rstrip), "normalized": bool(normalized), "special": bool(special)}


def tokenizer_json_dict(vocab: Mapping[str, int], merges: Iterable[Sequence[str]],
                        added_tokens: Iterable[Mapping]) -> dict:
    """The tokenizer.json document of a Qwen2 tokenizer (the layout of the real Qwen2/Qwen2.5 one).

    `merges`: pairs (left, right) in priority order; `added_tokens`: entries as `added_token_entry` makes.
    """
    added = sorted((dict(t) for t in added_tokens), key=lambda t: t["id"])
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_PRETOKENIZE_REGEX}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", **_BYTE_LEVEL},
            ],
        },
        "post_processor": {"type": "ByteLevel", **_BYTE_LEVEL},
        "decoder": {"type": "ByteLevel", **_BYTE_LEVEL},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(vocab),
            "merges": [[a, b] for a, b in merges],
        },
    }


def read_merges(path: Path) -> list[tuple[str, str]]:
    """merges.txt: optional '#version' header, then one 'left right' pair a line."""
    merges = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line or (n == 1 and line.startswith("#version")):
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise CheckpointError(f"{path}: line {n} is not a merge pair: {line!r}")
            merges.append((parts[0], parts[1]))
    return merges


def read_added_tokens(tokenizer_dir: Path) -> list[dict]:
    """Added tokens with their ids: tokenizer_config.json's added_tokens_decoder, else added_tokens.json."""
    cfg_path = tokenizer_dir / TOKENIZER_CONFIG_JSON
    if cfg_path.is_file():
        cfg = _read_json(cfg_path)
        decoder = cfg.get("added_tokens_decoder")
        if isinstance(decoder, Mapping) and decoder:
            out = []
            for tid, t in decoder.items():
                out.append(added_token_entry(
                    int(tid), t["content"], t.get("special", True), lstrip=t.get("lstrip", False),
                    rstrip=t.get("rstrip", False), single_word=t.get("single_word", False),
                    normalized=t.get("normalized", False)))
            return sorted(out, key=lambda t: t["id"])
    added_path = tokenizer_dir / ADDED_TOKENS_JSON
    if added_path.is_file():
        special = set()
        smap_path = tokenizer_dir / "special_tokens_map.json"
        if smap_path.is_file():
            for v in _read_json(smap_path).values():
                for item in (v if isinstance(v, list) else [v]):
                    special.add(item["content"] if isinstance(item, Mapping) else item)
        return sorted((added_token_entry(int(i), tok, tok in special or tok.startswith("<|"))
                       for tok, i in _read_json(added_path).items()), key=lambda t: t["id"])
    raise CheckpointError(
        f"tokenizer in {tokenizer_dir} has no added-token list: {cfg_path.name} lacks added_tokens_decoder "
        f"and {ADDED_TOKENS_JSON} is missing",
        "without them <|im_start|> and the other special tokens would be split into bytes")


def load_tokenizer(tokenizer_dir: str | Path) -> Tokenizer:
    """The checkpoint's tokenizer, from tokenizer.json if present, else from vocab.json + merges.txt."""
    d = Path(tokenizer_dir)
    if not d.is_dir():
        raise CheckpointError(f"tokenizer directory {d} does not exist")
    tj = d / TOKENIZER_JSON
    if tj.is_file():
        try:
            return Tokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"cannot read {tj}: {e}") from None
    missing = [n for n in (VOCAB_JSON, MERGES_TXT) if not (d / n).is_file()]
    if missing:
        raise CheckpointError(
            f"tokenizer in {d} is incomplete: no {TOKENIZER_JSON} and no {' / '.join(missing)}",
            f"a tokenizer needs either {TOKENIZER_JSON} or {VOCAB_JSON} + {MERGES_TXT} + {TOKENIZER_CONFIG_JSON}")
    if not (d / TOKENIZER_CONFIG_JSON).is_file() and not (d / ADDED_TOKENS_JSON).is_file():
        raise CheckpointError(f"tokenizer in {d} is incomplete: no {TOKENIZER_CONFIG_JSON}",
                              "it carries the special tokens (<|im_start|>, ...) and their ids")
    vocab = _read_json(d / VOCAB_JSON)
    merges = read_merges(d / MERGES_TXT)
    added = read_added_tokens(d)
    return tokenizer_from_parts(vocab, merges, added, where=str(d))


def tokenizer_from_parts(vocab: Mapping[str, int], merges: Iterable[Sequence[str]],
                         added_tokens: Iterable[Mapping], where: str = "tokenizer") -> Tokenizer:
    added = list(added_tokens)
    try:
        tok = Tokenizer.from_str(json.dumps(tokenizer_json_dict(vocab, merges, added)))
    except Exception as e:
        raise CheckpointError(f"{where}: cannot build the BPE tokenizer: {e}") from None
    for t in added:  # tokenizers assigns added-token ids itself; make sure they are the checkpoint's ids
        got = tok.token_to_id(t["content"])
        if got != t["id"]:
            raise CheckpointError(f"{where}: added token {t['content']!r} got id {got}, expected {t['id']}",
                                  "added-token ids must follow the vocabulary without gaps")
    return tok


def template_prefix_length(tokenizer: Tokenizer, template: str = TEMPLATE) -> int:
    """Tokens of the template before the prompt (its system part plus '<|im_start|>user\\n')."""
    prefix = template.split("{}")[0]
    return len(tokenizer.encode(prefix, add_special_tokens=False).ids)


def _read_json(path: Path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None

"""Model sources: the embedded default, local directories, and hub ids through the local hub cache."""

import shutil

import pytest

from qic.builder.source import resolve_model
from qic.errors import CheckpointError


def _fake_hub_cache(root, repo_id, ckpt):
    """The huggingface-hub cache layout: blobs named by content, snapshots of symlinks, refs/main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    shutil.copytree(ckpt, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_hub_id_resolves_offline_from_the_local_hub_cache(tmp_path, tiny_ckpt, monkeypatch):
    hub = tmp_path / "hub"
    snap = _fake_hub_cache(hub, "Qwen/Qwen-Image", tiny_ckpt)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    ckpt = resolve_model("Qwen/Qwen-Image", tmp_path / "cache")
    assert ckpt.root.resolve() == snap.resolve() and ckpt.model_id == "Qwen/Qwen-Image"
    assert ckpt.config("transformer")["_class_name"] == "QwenImageTransformer2DModel"
    missing = "Qwen/Qwen-Image-2512: not in the local hub cache and HF_HUB_OFFLINE"
    with pytest.raises(CheckpointError, match=missing) as e:
        resolve_model("Qwen/Qwen-Image-2512", tmp_path / "cache")
    # The fix names a command the installed huggingface-hub ships (2.x has `hf`, not `huggingface-cli`).
    from importlib.metadata import entry_points
    command = e.value.hint.split("(")[1].split()[0]
    shipped = {ep.name for ep in entry_points(group="console_scripts") if ep.value.startswith("huggingface_hub")}
    assert command in shipped
    assert "hf download Qwen/Qwen-Image-2512" in e.value.hint


def test_local_directory_and_embedded(tmp_path, tiny_ckpt):
    assert resolve_model(str(tiny_ckpt), tmp_path).root == tiny_ckpt
    emb = resolve_model(None, tmp_path)
    assert emb.model_id == "embedded:shapes" and (emb.root / "model_index.json").is_file()   # the default
    assert resolve_model("embedded:tiny", tmp_path).model_id == "embedded:tiny"
    with pytest.raises(CheckpointError, match="not found"):
        resolve_model(str(tmp_path / "missing"), tmp_path)


def test_digest_sees_content_identity_not_only_headers(tmp_path, tiny_ckpt):
    """Same headers and sizes (like Qwen-Image vs Qwen-Image-2512) must not share a digest."""
    from qic.checkpoint.reader import Checkpoint
    a = tmp_path / "a"
    shutil.copytree(tiny_ckpt, a)
    before = Checkpoint(a).digest()
    f = a / "vae" / "diffusion_pytorch_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01  # same size, same header, other weights
    f.write_bytes(bytes(data))
    assert Checkpoint(a).digest() != before
    assert Checkpoint(a).digest(full=True) != Checkpoint(tiny_ckpt).digest(full=True)

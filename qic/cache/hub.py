"""A compile store in a Hugging Face Hub repository, through huggingface-hub.

    REPO/graphs/<key[:2]>/<key>/{graph.pt2, constants.safetensors, meta.json, signature.json, done}

Two-level prefixes keep folders under the Hub's per-folder entry limit. Publishing uploads every new
file first (preupload_lfs_files), then makes one commit with parent_commit = the head it saw, so a
concurrent writer makes the commit fail (409/412) instead of being overwritten; it then re-reads
the head, drops entries that appeared meanwhile (content-addressed, so they are the same), and
retries. After a 5xx it first checks whether the commit landed anyway. Reading verifies everything
the local store does, plus the signature (qic.cache.remote).
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

from qic.cache import layout, store
from qic.errors import ConfigError, warn
from qic.fsutil import make_temp_dir

RETRIES = 6
HUB_SCHEME = "hf://"


def hub_repo(url) -> str | None:
    """ORG/REPO of a Hub store's URL (hf://ORG/REPO), or None for anything else (a directory)."""
    text = str(url)
    return text[len(HUB_SCHEME):].strip("/") if text.startswith(HUB_SCHEME) else None


def _prefix(gkey: str) -> str:
    return f"graphs/{gkey[:2]}/{gkey}"


class HubRemote:
    def __init__(self, repo_id: str, public_keys: list[str], trusted: bool):
        from huggingface_hub import HfApi
        self.repo_id, self.public_keys, self.trusted = repo_id.strip("/"), public_keys, trusted
        self.api = HfApi()

    def __str__(self) -> str:
        return f"{HUB_SCHEME}{self.repo_id}"

    # ---- reading ----------------------------------------------------------------------------------

    def head(self) -> str:
        return self.api.repo_info(self.repo_id).sha

    def present(self, revision: str | None = None) -> set[str]:
        """Keys of complete entries (their `done` marker is committed, and it is committed last-or-with)."""
        try:
            files = self.api.list_repo_files(self.repo_id, revision=revision)
        except Exception as e:
            raise ConfigError(f"{self}: cannot list the repository ({type(e).__name__}: {str(e).splitlines()[0]})",
                              "check the repo id, HF_TOKEN and your network") from None
        return {f.split("/")[2] for f in files if f.startswith("graphs/") and f.endswith(f"/{store.DONE}")}

    def fetch(self, gkey: str, cache_dir: Path, identity: dict, revision: str | None = None) -> dict | None:
        """Download one entry, verify it (hashes, identity, signature) and adopt it into the local store."""
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError
        cache_dir = Path(cache_dir)
        layout.graphs_dir(cache_dir).mkdir(parents=True, exist_ok=True)
        # A leftover name with this process as owner: a killed pull's download is swept (qic.fsutil).
        tmp = make_temp_dir(layout.graphs_dir(cache_dir) / f"pull-{gkey}")
        try:
            get = lambda name: hf_hub_download(self.repo_id, f"{_prefix(gkey)}/{name}",  # noqa: E731
                                               revision=revision, local_dir=tmp)
            try:
                get(store.DONE)
                get(store.META)
            except EntryNotFoundError:
                return None
            import json
            src = tmp / _prefix(gkey)
            try:
                meta = json.loads((src / store.META).read_text())
                for name in meta["files"]:
                    if "/" in name or "\\" in name or name.startswith("."):
                        break  # never fetch outside the entry; store.adopt refuses the entry
                    get(name)
            except (ValueError, KeyError, TypeError, EntryNotFoundError):
                pass  # store.adopt reports it as corrupted
            try:
                get(store.SIGNATURE)
            except EntryNotFoundError:
                pass  # store.adopt refuses it unless the store is trusted
            return store.adopt(src, cache_dir, gkey, identity, self.public_keys, self.trusted, str(self))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def pull(self, cache_dir: Path, identity: dict) -> tuple[int, int]:
        """Every entry the repo holds for this toolchain and machine: (adopted, refused or not for here)."""
        revision = self.head()
        ok = bad = 0
        for gkey in sorted(self.present(revision)):
            if store.lookup(cache_dir, gkey, identity, quiet=True):
                continue
            with layout.graph_lock(cache_dir, gkey):  # as compile_graph holds it
                got = self.fetch(gkey, cache_dir, identity, revision)
            if got:
                ok += 1
            else:
                bad += 1
        return ok, bad

    # ---- publishing -------------------------------------------------------------------------------

    def push(self, cache_dir: Path, sleep=time.sleep) -> list[str]:
        """Publish the local store's complete, intact entries the repo lacks; returns their keys."""
        from huggingface_hub import CommitOperationAdd
        from huggingface_hub.errors import HfHubHTTPError
        local = {e.key: e for e in store.entries(cache_dir) if e.problem is None}
        head = self.head()
        todo = sorted(set(local) - self.present(head))
        if not todo:
            return []
        ops = {k: [CommitOperationAdd(f"{_prefix(k)}/{p.name}", str(p))
                   for p in sorted(local[k].path.iterdir(), key=lambda p: p.name == store.DONE)  # done last
                   if p.is_file() and p.name != store.ORIGIN] for k in todo}   # where *we* got it: ours
        # Blobs first: a conflicting commit then only costs the (cheap) commit, not the uploads.
        self.api.preupload_lfs_files(self.repo_id, additions=[op for k in todo for op in ops[k]])
        for attempt in range(RETRIES):
            try:
                self.api.create_commit(self.repo_id, operations=[op for k in todo for op in ops[k]],
                                       commit_message=f"qic cache: {len(todo)} entries", parent_commit=head)
                return todo
            except HfHubHTTPError as e:
                status = e.response.status_code if e.response is not None else 0
                if status not in (409, 412) and status < 500:
                    raise
                # A conflict, or a server error after which the commit may have landed: look before retrying.
                head = self.head()
                landed = self.present(head)
                todo = [k for k in todo if k not in landed]
                if not todo:
                    return []
                warn(f"{self}: commit failed with HTTP {status}; retrying on head {head[:12]} "
                     f"({len(todo)} entries left, attempt {attempt + 2} of {RETRIES})")
                sleep(min(30.0, 2 ** attempt) * (0.5 + random.random() / 2))
        raise ConfigError(f"{self}: could not commit after {RETRIES} attempts (the repo keeps changing)",
                          "run `qic cache push` again")

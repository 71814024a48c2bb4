"""A STAND-IN for the Hugging Face Hub's HTTP API, on 127.0.0.1, for the store tests. Not the Hub.

It answers only the calls qic's Hub store makes through huggingface-hub (with HF_HUB_DISABLE_XET=1,
so uploads use the plain LFS protocol): repo info, recursive tree listing, preupload, the LFS batch
API and PUT uploads, NDJSON commits (with the parent_commit check: 412 when the head moved), and
resolve (HEAD/GET) downloads. `fail_commits` queues status codes for the next commits; a 500 may be
told to apply the commit anyway (the Hub once did exactly that).
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class HubStandIn:
    def __init__(self, repo_id: str):
        self.repo_id = repo_id
        self.files: dict[str, bytes] = {}          # path -> content at head
        self.blobs: dict[str, bytes] = {}          # sha256 -> uploaded LFS content
        self.head = hashlib.sha1(b"initial").hexdigest()
        self.commits: list[dict] = []
        self.fail_commits: list[tuple[int, bool]] = []   # (status, apply the commit anyway)
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()

    def _apply(self, lines: list[dict]) -> None:
        new = dict(self.files)
        for item in lines[1:]:
            v = item["value"]
            if item["key"] == "file":
                new[v["path"]] = base64.b64decode(v["content"])
            elif item["key"] == "lfsFile":
                new[v["path"]] = self.blobs[v["oid"]]
        self.files = new
        self.head = hashlib.sha1((self.head + json.dumps(lines[0])).encode()).hexdigest()
        self.commits.append({"parent": lines[0]["value"].get("parentCommit"), "paths": [
            i["value"]["path"] for i in lines[1:]]})

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, obj, status: int = 200):
                self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_GET(self, head: bool = False):
                path = unquote(urlparse(self.path).path)
                api = f"/api/models/{hub.repo_id}"
                if path in (api, f"{api}/revision/main") or path.startswith(f"{api}/revision/"):
                    with hub.lock:
                        return self._json({"id": hub.repo_id, "sha": hub.head,
                                           "siblings": [{"rfilename": p} for p in sorted(hub.files)]})
                if path.startswith(f"{api}/tree/"):
                    with hub.lock:
                        return self._json([{"type": "file", "path": p, "size": len(c),
                                            "oid": hashlib.sha1(c).hexdigest()} for p, c in sorted(hub.files.items())])
                prefix = f"/{hub.repo_id}/resolve/"
                if path.startswith(prefix):
                    _, _, name = path[len(prefix):].partition("/")
                    with hub.lock:
                        content, commit = hub.files.get(name), hub.head
                    if content is None:
                        return self._send(404, b"not found", {"X-Error-Code": "EntryNotFound",
                                                               "X-Repo-Commit": commit}, head)
                    return self._send(200, content, {"X-Repo-Commit": commit,
                                                     "ETag": f'"{hashlib.sha256(content).hexdigest()}"'}, head)
                self._send(404, b"unknown endpoint (hub stand-in)")

            def do_HEAD(self):
                self.do_GET(head=True)

            def do_POST(self):
                path = unquote(urlparse(self.path).path)
                body = self._body()
                api = f"/api/models/{hub.repo_id}"
                if path.startswith(f"{api}/preupload/"):
                    files = json.loads(body)["files"]
                    return self._json({"files": [{"path": f["path"], "uploadMode": "lfs" if f["size"] else "regular",
                                                  "shouldIgnore": False} for f in files]})
                if path == f"/{hub.repo_id}.git/info/lfs/objects/batch":
                    objects = []
                    for o in json.loads(body)["objects"]:
                        entry = {"oid": o["oid"], "size": o["size"]}
                        if o["oid"] not in hub.blobs:
                            entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}
                        objects.append(entry)
                    return self._json({"transfer": "basic", "objects": objects})
                if path.startswith(f"{api}/commit/"):
                    lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                    with hub.lock:
                        if hub.fail_commits:
                            status, apply = hub.fail_commits.pop(0)
                            if apply:
                                hub._apply(lines)
                            return self._json({"error": f"injected {status} (hub stand-in)"}, status)
                        parent = lines[0]["value"].get("parentCommit")
                        if parent and parent != hub.head:
                            return self._json({"error": "A commit has happened since. Please refresh and try again."},
                                              412)
                        hub._apply(lines)
                        return self._json({"commitOid": hub.head, "commitUrl": f"{hub.url}/{hub.repo_id}/commit/"
                                           f"{hub.head}", "success": True})
                self._send(404, b"unknown endpoint (hub stand-in)")

            def do_PUT(self):
                path = urlparse(self.path).path
                if path.startswith("/lfs-upload/"):
                    oid = path.rsplit("/", 1)[1]
                    body = self._body()
                    if hashlib.sha256(body).hexdigest() != oid:
                        return self._send(400, b"sha256 mismatch")
                    with hub.lock:
                        hub.blobs[oid] = body
                    return self._send(200)
                self._send(404, b"unknown endpoint (hub stand-in)")

        return Handler

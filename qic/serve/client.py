"""A minimal stdlib HTTP client for a local `qic serve` (its tests and benchmark; no extra dependency)."""

from __future__ import annotations

import http.client
import json


def request(port: int, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 60,
            host: str = "127.0.0.1"):
    """(status, lower-cased headers, parsed JSON body or None) over a fresh connection."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        payload = resp.read()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        return resp.status, headers, json.loads(payload) if payload else None
    finally:
        conn.close()

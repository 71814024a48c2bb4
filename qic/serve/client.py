"""A minimal stdlib HTTP client for a local `qic serve` (its tests and benchmark; no extra dependency)."""

from __future__ import annotations

import http.client
import json


def request(port: int, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 60,
            host: str = "127.0.0.1"):
    """(status, lower-cased headers, body) over a fresh connection: the body parsed from JSON, as text when the
    server says it is another type (GET /metrics), or None when empty."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        payload = resp.read()
        headers = {k.lower(): v for k, v in resp.getheaders()}
        if not payload:
            return resp.status, headers, None
        if headers.get("content-type", "application/json").startswith("application/json"):
            return resp.status, headers, json.loads(payload)
        return resp.status, headers, payload.decode()
    finally:
        conn.close()

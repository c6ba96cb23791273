"""The live page (page.html): one file, its style and script inline, nothing fetched from elsewhere (no scripts,
fonts or CDNs: it works with no network). Its Content-Security-Policy allows exactly its own inline style and script
(by their SHA-256), connections to its own server only, and no framing (its buttons park apps)."""
from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

HTML = (Path(__file__).parent / "page.html").read_bytes()


def _hashes(tag: str) -> str:
    blocks = re.findall(rb"<%s>(.*?)</%s>" % (tag.encode(), tag.encode()), HTML, re.S)
    return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in blocks)


HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_hashes('script')}; style-src {_hashes('style')}; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

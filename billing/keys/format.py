"""What an API key looks like: the one rule that authentication (gateway/http/requests.py, the dashboard's
login), the admin key given at start (`TOLLGATE_ADMIN_KEY`, gateway/config.py and
`KeyStore.ensure_admin_key`) and the masking of keys in logs, error messages and echoed headers
all use. No dependencies: imported by the error and logging modules.

A key is `sk-` and 17 to 197 more characters from the URL-unreserved set (letters, digits and
`. _ ~ -`), 20 to 200 characters in all. Keys Tollgate makes (`sk-` + 43 url-safe base64
characters) are of this shape; a key outside it is never looked up, so it could never log in.
"""

from __future__ import annotations

import re

PREFIX = "sk-"
MIN_LENGTH = 20
MAX_LENGTH = 200
_CHARS = r"A-Za-z0-9._~\-"
_KEY = re.compile(rf"sk-[{_CHARS}]{{{MIN_LENGTH - len(PREFIX)},{MAX_LENGTH - len(PREFIX)}}}")
# Anything that could be a key, or the start of one, inside longer text, masked as `sk-***`: `sk-`
# not glued to a word before it ("task-12" is no key) and four or more key characters; or, glued to
# anything, a whole key's length of them (a client's "zz<key>" still holds the key).
_KEY_IN_TEXT = re.compile(rf"(?<![A-Za-z0-9])sk-[{_CHARS}]{{4,}}|sk-[{_CHARS}]{{{MIN_LENGTH - len(PREFIX)},}}")
MASK = "sk-***"
# Stripe's secrets that the billing settings hold (secret and restricted keys, the webhook signing
# secret): masked too, should a library's error or a log line quote one.
_STRIPE_SECRET = re.compile(r"(?<![A-Za-z0-9])(?:(?:sk|rk)_(?:live|test)_[A-Za-z0-9]{8,}|whsec_[A-Za-z0-9+/=]{8,})")
STRIPE_MASK = "***"


def key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key (a phrase to follow "the key "), or None when it can. Never
    quotes the key."""
    if not key.startswith(PREFIX):
        return f"does not start with {PREFIX!r}"
    if len(key) < MIN_LENGTH:
        return f"is {len(key)} characters long; a key has at least {MIN_LENGTH} ({PREFIX!r} and {MIN_LENGTH - len(PREFIX)} more)"
    if len(key) > MAX_LENGTH:
        return f"is {len(key)} characters long; a key has at most {MAX_LENGTH}"
    if _KEY.fullmatch(key) is None:
        return f"holds characters other than letters, digits and . _ ~ - after {PREFIX!r}"
    return None


def looks_like_key(key: str) -> bool:
    """Whether authentication looks `key` up at all (the same rule as `key_problem`)."""
    return _KEY.fullmatch(key) is not None


def mask_keys(text: str) -> str:
    """`text` with everything shaped like an API key replaced by `sk-***`, and Stripe's secrets by `***`."""
    if PREFIX in text:
        text = _KEY_IN_TEXT.sub(MASK, text)
    if "k_" in text or "whsec_" in text:
        text = _STRIPE_SECRET.sub(STRIPE_MASK, text)
    return text

"""Node keys: what decides a node's output, hashed.

    key = sha256(kind | code fingerprint | params digest | input digest)

Where the input lives is not part of it: moving a partition keeps its nodes' keys.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc


def sha256_json(value: Any) -> str:
    """Digest of a value's canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def code_fingerprint(*objects: Callable | ModuleType) -> str:
    """Digest of the source of functions or modules: edit them and the keys change."""
    h = hashlib.sha256()
    for obj in objects:
        h.update(getattr(obj, "__qualname__", getattr(obj, "__name__", "")).encode())
        h.update(inspect.getsource(obj).encode())
    return h.hexdigest()


_KEY_PREFIXES: dict[tuple[str, str, str], Any] = {}


def _key_state(kind: str, code: str, params: str) -> Any:
    # sha256 streams: a copy of the state of "kind|code|params|" updated with the input
    # digest equals sha256(f"{kind}|{code}|{params}|{digest}"), at a third of the cost.
    prefix = (kind, code, params)
    state = _KEY_PREFIXES.get(prefix)
    if state is None:
        state = _KEY_PREFIXES.setdefault(prefix, hashlib.sha256("|".join(prefix + ("",)).encode()))
    return state


def node_keys(kind: str, code: str, params: Sequence[str], inputs: Sequence[str]) -> list[str]:
    """Keys of many nodes of one kind and code (~0.6 us a node here)."""
    keys = []
    for p, digest in zip(params, inputs, strict=True):
        h = _key_state(kind, code, p).copy()
        h.update(digest.encode())
        keys.append(h.hexdigest())
    return keys


def keys_of(kind: str, code: str, params: pa.Array, inputs: pa.Array) -> pa.Array:
    """`node_keys` over Arrow columns: the inputs' digests go to sha256 as the bytes
    Arrow holds, and each row picks its parameters' hash state by a dictionary index
    (37 ms -> 27 ms per 50,000 keys here)."""
    params = pc.dictionary_encode(params)
    copies = [_key_state(kind, code, p).copy for p in params.dictionary.to_pylist()]
    keys = []
    append = keys.append
    for i, digest in zip(
        params.indices.to_pylist(), inputs.cast(pa.binary()).to_pylist(), strict=True
    ):
        h = copies[i]()
        h.update(digest)
        append(h.hexdigest())
    return pa.array(keys, pa.string())

"""Reading JSON files, gzipped or not, with one-line errors that name the file."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from pathlib import Path
from typing import Any

from grape.errors import GrapeError, SchemaVersionError

__all__ = ["dump_json", "leading_schema", "load_json"]


def load_json(path: str | Path, error: type[GrapeError] = GrapeError) -> Any:
    """Parse ``path`` as JSON, un-gzipping it first if it is gzip; failures raise ``error``."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise error(f"{path}: expected a readable file, found {e.strerror}") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise error(f"{path}: expected a complete gzip stream, found {e}") from None
    elif path.suffix == ".gz":
        raise error(f"{path}: expected gzip data (the name ends in .gz), found bytes "
                    f"starting {raw[:8]!r}")
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise error(f"{path}: expected UTF-8 JSON text, found binary data") from None
    except json.JSONDecodeError as e:
        cut = e.pos >= len(raw.rstrip()) or e.msg.startswith("Unterminated")
        hint = "; the file looks truncated" if cut else ""
        raise error(f"{path}: expected JSON, found {e.msg.lower()!r} at line {e.lineno} "
                    f"column {e.colno}{hint}") from None


def dump_json(path: str | Path, doc: Any, *, indent: int | None = None) -> Path:
    """Write ``doc`` as JSON, gzipped (reproducibly: no timestamp) when ``path`` ends in .gz."""
    path = Path(path)
    separators = None if indent is not None else (",", ":")
    data = json.dumps(doc, indent=indent, separators=separators).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data + b"\n")
    return path


def check_schema(doc: Any, schema: str, version: int | tuple[int, ...],
                 error: type[GrapeError], where: str = "") -> dict[str, Any]:
    """``doc`` if it is a ``schema`` document of ``version`` (or of one of several read);
    ``where`` prefixes messages."""
    if not isinstance(doc, dict) or doc.get("schema") != schema:
        found = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise error(f"{where}expected a {schema} document, found {found!r}")
    versions = version if isinstance(version, tuple) else (version,)
    if doc.get("version") not in versions:
        raise SchemaVersionError(f"{where}expected {schema} schema version "
                                 f"{' or '.join(map(str, versions))}, found "
                                 f"{doc.get('version')!r}")
    return doc


# grape writes "schema" as its documents' first key (dump_json keeps the order given).
_LEADING_SCHEMA = re.compile(rb'^\s*\{\s*"schema"\s*:\s*"([^"]{1,64})"')


def leading_schema(path: str | Path) -> str | None:
    """The ``schema`` a grape document at ``path`` names as its first key, read from its first
    bytes (un-gzipped where gzip) without parsing the rest: how a file named neither
    ``*.ir.json`` nor ``*.family.json`` is still known for a graph or a family. None where the
    file cannot be read or does not start so (a Chrome trace, a torch.profiler file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            raw = (gzip.GzipFile(fileobj=f).read(256) if head == b"\x1f\x8b" else f.read(256))
    except (OSError, EOFError, zlib.error):
        return None
    found = _LEADING_SCHEMA.match(raw)
    return found.group(1).decode("utf-8", "replace") if found else None

"""Conversation sources: opening them, reading their records, and which records train or eval.

A source (``data.path``) is one path or a list of them (``data.path=[a.jsonl,b.parquet]``), each
- a JSONL file (``.jsonl``, or a ``.json`` file of JSON lines): one ``{"messages": [...]}`` object
  per line, ShareGPT-style ``{"conversations": [{"from", "value"}]}`` accepted too; read here, line
  by line, so a bad line is one counted record;
- any other data file (``.json`` holding a JSON array, ``.parquet``, ``.csv``, ``.arrow``): read
  with ``datasets`` (its packaged builder for the extension);
- a folder: every data file in it and its subfolders, in sorted path order, each read as above on
  its own (so chat and ShareGPT files mix); sidecars (``*.meta.json``, ``*.failed.jsonl``) and
  hidden files are left out. A folder written by ``save_to_disk`` is loaded as that dataset;
- a glob (``/data/part-*.parquet``, ``/data/**/*.jsonl``): the matching files and folders, sorted;
- a ``datasets`` hub id (``data.split`` chooses the split), or ``embedded`` (the offline corpus of
  ``dflash.data.embedded``, built from the target; :func:`resolve_source` turns it into its file).
Every record says where it is: ``<file>:<line>`` (JSONL) or ``<file>[<row>]`` (``datasets``).

Layout of the source, by record index (all files in order; blank JSONL lines are not records):
``[0, num_train)`` is tokenized for training, with ``num_train = min(num_samples, total - E)``;
``[total - E, total)`` (E = ``num_eval_prompts``) is the held-out eval tail, never trained on
(:func:`split_ranges`; :func:`load_eval_conversations` reads the tail as message lists).

Unparseable records (invalid JSON or UTF-8, nesting too deep for the parser) come out as
:class:`BadRecord` and unusable ones raise ``MalformedConversation`` from :func:`parse_messages`:
the caller counts them, nothing here aborts on one record. Only a problem of the whole source (a
missing or unreadable file, no record at all) raises ``ValueError``, naming the config field and
the file.

A source may carry a sidecar ``<file>.meta.json`` (written by ``dflash.data.regenerate`` and by the
embedded corpus) recording the ``chat_template_kwargs`` its responses were generated with;
:func:`check_template_kwargs` refuses to tokenize it with different ones.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import json
import logging
import os
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from dflash.data.chat import MalformedConversation, validate_messages
from dflash.data.embedded import build_embedded_corpus, embedded_corpus_path
from dflash.files import file_digest

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
"""The ``data.path`` value that names the embedded corpus."""
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
}
_SHAREGPT_CALL = "function_call"
"""The ShareGPT ``from`` of an assistant turn that calls tools (LLaMA-Factory's format): its
``value`` is the JSON of one call ``{"name", "arguments"}`` or a list of them."""


@dataclass(frozen=True)
class BadRecord:
    """A source record that could not even be parsed (e.g. invalid JSON); counted as malformed."""

    reason: str


DATASETS_BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
"""Data-file extensions read with ``datasets`` (its packaged builder of that name); ``.json`` only
when the file holds a JSON array (JSON lines are read as JSONL)."""
_SIDECARS = (".meta.json", ".failed.jsonl")
_GLOB_CHARS = ("*", "?", "[")


def source_paths(value: Any, field: str = "data.path") -> list[str]:
    """``value`` (a path, or a list of paths, as ``data.path`` takes it) as a non-empty list of
    strings; ValueError naming ``field`` otherwise."""
    items = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not items or not all(isinstance(v, str) and v for v in items):
        raise ValueError(
            f"{field}={value!r}: give a file, a folder, a glob or a hub dataset id, or a list of them "
            f"({field}=[a.jsonl,b.parquet])"
        )
    return items


def resolve_data_path(value: Any, resolve: Callable[[str], str], field: str = "data.path") -> str | list[str]:
    """``value`` (a path or a list of paths; ``embedded`` unchanged) with ``resolve`` applied to each
    path, keeping its form (a string stays a string, a list a list)."""
    if value == EMBEDDED:
        return EMBEDDED
    paths = [resolve(p) for p in source_paths(value, field)]
    return paths[0] if isinstance(value, str) else paths


def _is_jsonl(path: Path) -> bool:
    """A ``.jsonl`` file, or a ``.json`` file whose first non-blank character does not open an array."""
    if path.suffix == ".jsonl":
        return True
    if path.suffix != ".json":
        return False
    with open(path, "rb") as fh:
        while chunk := fh.read(4096):
            stripped = chunk.removeprefix(codecs.BOM_UTF8).lstrip()
            if stripped:
                return not stripped.startswith(b"[")
    return True


def _data_files(folder: Path) -> list[Path]:
    """The data files of a folder and its subfolders in sorted path order (no hidden files, no sidecars)."""
    known = (".jsonl", *DATASETS_BUILDERS)
    return [
        f
        for f in sorted(folder.rglob("*"))
        if f.is_file()
        and f.suffix in known
        and not f.name.endswith(_SIDECARS)
        and not any(part.startswith(".") for part in f.relative_to(folder).parts)
    ]


class _Part:
    """One file (or one ``datasets`` dataset) of a source: its records with where each one is."""

    def __init__(
        self, name: str, jsonl: Path | None = None, dataset: Any = None, fingerprint: str = ""
    ) -> None:
        self.name, self.jsonl, self.dataset = name, jsonl, dataset
        if jsonl is not None:
            self.fingerprint, self.num_records = _scan_jsonl(jsonl)
        else:
            self.num_records = len(dataset)
            self.fingerprint = fingerprint or _content_hash(dataset)

    def numbered(self) -> Iterator[tuple[str, Any]]:
        if self.jsonl is None:
            for i, row in enumerate(self.dataset):
                yield f"{self.name}[{i}]", _drop_nones(row)
            return
        with open(self.jsonl, "rb") as fh:
            for lineno, raw in enumerate(fh, 1):
                if raw.strip():
                    yield f"{self.name}:{lineno}", _parse_line(raw)


def _drop_nones(row: Any) -> Any:
    """A ``datasets`` row without the ``None`` fields that schema unification adds (a ShareGPT row
    of a folder that also holds chat files gets ``messages: None``), in messages too, and at any
    depth in tool calls and tool definitions (Arrow gives every call the union of all calls'
    argument names); an explicit null there survives only in a JSON string."""
    if not isinstance(row, dict):
        return row
    out = {k: v for k, v in row.items() if v is not None}
    for key in ("messages", "conversations"):
        if isinstance(out.get(key), list):
            out[key] = [
                {k: _deep_drop_nones(v) if k == "tool_calls" else v for k, v in m.items() if v is not None}
                if isinstance(m, dict)
                else m
                for m in out[key]
            ]
    if "tools" in out:
        out["tools"] = _deep_drop_nones(out["tools"])
    return out


def _deep_drop_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_deep_drop_nones(v) for v in value]
    return value


class Source:
    """An opened conversation source: a content fingerprint, the record count and the records.

    ``path`` is a path or a list of paths (see the module docstring); ``field`` names the config
    field that gave it (``data.path``, ``input``, ``prompts``), so that every error about the
    source names what to change.
    """

    def __init__(self, path: str | list[str], split: str = "train", *, field: str = "data.path") -> None:
        self.path, self.split, self.field = path, split, field
        self.parts = [part for entry in source_paths(path, field) for part in self._open(entry)]
        self.num_records = sum(p.num_records for p in self.parts)
        if len(self.parts) == 1:
            self.fingerprint = self.parts[0].fingerprint
        else:
            joined = "\0".join(p.fingerprint for p in self.parts)
            self.fingerprint = f"parts:{hashlib.sha256(joined.encode()).hexdigest()}"
        if self.num_records == 0:
            raise ValueError(
                f"{field}={path!r} has no records (an empty file, or only blank lines); set {field} to a "
                'JSONL with one {"messages": [...]} object per line (or a non-empty dataset)'
            )

    def _open(self, entry: str) -> list[_Part]:
        p = Path(entry).expanduser()
        if not p.exists() and any(c in entry for c in _GLOB_CHARS):
            matches = [Path(m) for m in sorted(glob.glob(str(p), recursive=True))]
            if not matches:
                raise ValueError(f"{self.field}={entry!r}: the glob matches no file; check the pattern")
            return [part for m in matches for part in self._open_local(m)]
        if p.exists():
            return self._open_local(p)
        if p.suffix in (".jsonl", *DATASETS_BUILDERS) or entry.startswith((".", "/", "~")):
            raise ValueError(
                f"{self.field}={entry!r} does not exist; set {self.field} to a JSONL file, a data file, "
                "a folder, a glob or a dataset"
            )
        return [_Part(entry, dataset=_load_hf_dataset(entry, self.split, self.field))]

    def _open_local(self, p: Path) -> list[_Part]:
        if p.is_dir():
            if (p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists():
                return [_Part(str(p), dataset=_load_hf_dataset(str(p), self.split, self.field))]
            files = _data_files(p)
            if not files:
                raise ValueError(
                    f"{self.field}={str(p)!r}: the folder holds no data file "
                    f"({', '.join(('.jsonl', *DATASETS_BUILDERS))}); check the folder"
                )
            return [part for f in files for part in self._open_local(f)]
        try:
            if _is_jsonl(p):
                return [_Part(str(p), jsonl=p)]
        except OSError as exc:
            raise ValueError(f"{self.field}={str(p)!r} cannot be read ({exc}); check the file") from exc
        except NotUtf8 as exc:
            out = shlex.quote(str(p.with_name(p.stem + ".utf8" + p.suffix)))
            raise NotUtf8(
                f"{self.field}={str(p)!r} {exc} {shlex.quote(str(p))} > {out} and set {self.field} to it "
                "(JSONL is read as UTF-8)"
            ) from None
        builder = DATASETS_BUILDERS.get(p.suffix)
        if builder is None:
            raise ValueError(
                f"{self.field}={str(p)!r}: unknown data file type {p.suffix!r}; give .jsonl, "
                f"{', '.join(DATASETS_BUILDERS)} files, a folder of them, or a dataset"
            )
        ds = _load_hf_file(p, builder, self.field)
        return [_Part(str(p), dataset=ds, fingerprint=f"{builder}:{file_digest(p)['sha256']}")]

    def numbered(self) -> Iterator[tuple[int, str, Any]]:
        """``(record index, where, record)`` in order over every file; ``where`` is
        ``<file>:<line>`` (JSONL) or ``<file>[<row>]`` (``datasets``), for messages that point at
        the record."""
        idx = 0
        for part in self.parts:
            try:
                for where, record in part.numbered():
                    yield idx, where, record
                    idx += 1
            except OSError as exc:
                raise ValueError(
                    f"{self.field}={part.name!r} cannot be read ({exc}); check the file"
                ) from exc

    def records(self) -> Iterator[Any]:
        """Every record in order: a parsed JSON value, a ``datasets`` row dict, or a BadRecord."""
        for _, _, record in self.numbered():
            yield record


def _parse_line(raw: bytes) -> Any:
    """One JSONL line as a JSON value, or a :class:`BadRecord` saying why it is not one."""
    try:
        return json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        return BadRecord(f"invalid JSON ({exc})")
    except RecursionError:  # e.g. a line of 200,000 '['
        return BadRecord("invalid JSON (nested too deeply for the parser)")


class NotUtf8(ValueError):
    """A JSONL file in another encoding than UTF-8 (the message says which, and how to convert)."""


_BOMS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    (codecs.BOM_UTF32_LE, "UTF-32LE"),
    (codecs.BOM_UTF32_BE, "UTF-32BE"),
    (codecs.BOM_UTF16_LE, "UTF-16LE"),
    (codecs.BOM_UTF16_BE, "UTF-16BE"),
)
_LEGACY = ("cp1252", "latin1")
"""The single-byte encodings a non-UTF-8 line is tried in (Windows-1252 leaves 5 bytes undefined)."""


def _wide_encoding(head: bytes) -> str | None:
    """The UTF-16/32 encoding the first bytes of a file show (a byte-order mark, or the NUL bytes
    of ASCII text such as ``{"``, as JSON's own detection reads them), else None."""
    for bom, name in _BOMS:
        if head.startswith(bom):
            return f"{name} (byte-order mark {bom.hex(' ').upper()})"
    if b"\0" in head[:4]:
        name = json.detect_encoding(head[:4]).upper().replace("-LE", "LE").replace("-BE", "BE")
        return f"{name} (NUL bytes between the characters, no byte-order mark)"
    return None


def _legacy_line(raw: bytes) -> tuple[str, int, str] | None:
    """``(encoding, offset, character)`` of ``raw`` (not UTF-8) when it is a JSON line in a
    single-byte encoding (Windows-1252, else Latin-1), at the first byte UTF-8 rejects; None for a
    corrupt line that no encoding makes JSON."""
    try:
        raw.decode("utf-8")
        return None
    except UnicodeDecodeError as exc:
        offset = exc.start
    for encoding in _LEGACY:
        try:
            json.loads(raw.decode(encoding))
        except ValueError:  # UnicodeDecodeError (cp1252's undefined bytes) and JSONDecodeError
            continue
        return encoding, offset, raw[offset : offset + 1].decode(encoding)
    return None


def _scan_jsonl(path: Path) -> tuple[str, int]:
    """(``jsonl:`` + sha256 of the file bytes, number of non-blank lines).

    Raises :class:`NotUtf8` for a file in another encoding: UTF-16 or UTF-32 (a byte-order mark, or
    NUL bytes in its first characters), or a file whose non-ASCII lines are none of them UTF-8 while
    one is JSON in Windows-1252 or Latin-1 (a file saved in a legacy encoding). A UTF-8 byte-order
    mark is fine (JSON's own decoding skips it); in a file with UTF-8 text elsewhere, a line that is
    not UTF-8 is a damaged record (malformed, counted), not the file's encoding."""
    h, n = hashlib.sha256(), 0
    utf8_lines, legacy = 0, None
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if lineno == 1 and (wide := _wide_encoding(raw + fh.peek(4)[:4])) is not None:
                raise NotUtf8(f"is {wide}, not UTF-8; convert it: iconv -f {wide.split()[0]} -t UTF-8")
            h.update(raw)
            if raw.strip():
                n += 1
            if not raw.isascii():
                if _is_utf8(raw):
                    utf8_lines += 1
                elif legacy is None and (found := _legacy_line(raw)) is not None:
                    legacy = (lineno, *found)
    if legacy is not None and not utf8_lines:
        lineno, encoding, offset, char = legacy
        legacy_name = "Windows-1252" if encoding == "cp1252" else "Latin-1"
        raise NotUtf8(
            f"is {legacy_name}, not UTF-8: line {lineno}, column {offset + 1} has byte "
            f"0x{char.encode(encoding)[0]:02X} ({char!r} in {legacy_name}) and no line holds UTF-8 text; convert it: "
            f"iconv -f {encoding.upper()} -t UTF-8"
        )
    return f"jsonl:{h.hexdigest()}", n


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _import_datasets(path: str, field: str) -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(
            f"{field}={path!r} is not a JSONL file, so it is read with `datasets`, but `datasets` is "
            "not installed: pip install 'dflash[data]' (or datasets), or convert it to JSONL"
        ) from exc
    return datasets


def _load_hf_file(path: Path, builder: str, field: str) -> Any:
    """One local data file through ``datasets``' packaged builder (a JSON array, parquet, csv, arrow)."""
    datasets = _import_datasets(str(path), field)
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many types for a bad file
        raise ValueError(
            f"{field}={str(path)!r}: `datasets` cannot read it as {builder} ({type(exc).__name__}: {exc}); "
            "check the file"
        ) from None


def _load_hf_dataset(path: str, split: str, field: str = "data.path") -> Any:
    datasets = _import_datasets(path, field)
    p = Path(path)
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(p))
    else:
        ds = datasets.load_dataset(path, split=split)
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            split_field = "data.split" if field == "data.path" else "split"
            raise ValueError(
                f"{split_field}={split!r} is not in {path!r} (splits: {sorted(ds)}); set {split_field}"
            )
        ds = ds[split]
    return ds


def _content_hash(ds: Any) -> str:
    fp = getattr(ds, "_fingerprint", None)
    if fp:
        return f"datasets:{fp}"
    h = hashlib.sha256()
    for row in ds:
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
    return f"rows:{h.hexdigest()}"


def load_conversations(path: str, split: str = "train", *, field: str = "data.path") -> Iterator[Any]:
    """Raw records of a JSONL file or a ``datasets`` path, in order (see :class:`Source`).

    JSONL lines that fail to parse come out as :class:`BadRecord` (counted, never raised); use
    :func:`parse_messages` to turn a record into a validated message list.
    """
    return Source(path, split, field=field).records()


class Conversation(NamedTuple):
    """A record as the chat template gets it."""

    messages: list[dict]
    """Validated and in template form (``dflash.data.chat.validate_messages``)."""
    tools: list[dict] | None
    """The record's tool definitions (``{"type": "function", "function": {...}}`` each), or None."""


def parse_conversation(record: Any) -> Conversation:
    """A record's messages (``messages``, or ShareGPT ``conversations`` with from/value) and tool
    definitions (``tools``: a list, or its JSON string as LLaMA-Factory writes it; a bare function
    schema is wrapped as the OpenAI API sends it). ShareGPT ``function_call`` turns are assistant
    tool calls and ``observation`` turns tool results.

    Raises :class:`MalformedConversation` on anything unusable.
    """
    if isinstance(record, BadRecord):
        raise MalformedConversation(record.reason)
    if not isinstance(record, dict):
        raise MalformedConversation(f"record is a {type(record).__name__}, not an object")
    tools = _tools(record.get("tools"))
    if "messages" in record:
        return Conversation(validate_messages(record["messages"]), tools)
    conv = record.get("conversations")
    if isinstance(conv, list) and conv and all(isinstance(m, dict) and "from" in m for m in conv):
        conv = [_sharegpt_message(i, m) for i, m in enumerate(conv)]
    if conv is None:
        raise MalformedConversation("record has no 'messages' (or 'conversations') field")
    return Conversation(validate_messages(conv), tools)


def parse_messages(record: Any) -> list[dict]:
    """A record's message list (:func:`parse_conversation` without the tools)."""
    return parse_conversation(record).messages


def _sharegpt_message(i: int, m: dict) -> dict:
    if m["from"] != _SHAREGPT_CALL:
        out = {"role": _SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
        return {**out, **({"tool_calls": m["tool_calls"]} if "tool_calls" in m else {})}
    value = m.get("value")
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except ValueError as exc:
        raise MalformedConversation(f"message {i} (function_call) is not JSON ({exc})") from None
    calls = calls if isinstance(calls, list) else [calls]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _tools(value: Any) -> list[dict] | None:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise MalformedConversation(f"'tools' is a string that is not JSON ({exc})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise MalformedConversation("'tools' must be a list of tool definitions (objects)")
    return [
        t if "function" in t or "name" not in t else {"type": "function", "function": t} for t in value
    ] or None


def cache_root(cfg: Any) -> Path:
    """``cfg.cache_dir`` (a DataConfig's) as a Path: the root of the dataset cache and of the
    embedded corpus. Raises ValueError on an unresolved ``${...}`` interpolation."""
    root = str(cfg.cache_dir)
    if "${" in root:
        raise ValueError(f"data.cache_dir={root!r} is an unresolved interpolation; pass a resolved config")
    return Path(root)


def resolve_source(cfg: Any, target_dir: str | os.PathLike | None = None) -> str | list[str]:
    """``cfg.path`` (a path or a list of paths, see :class:`Source`), or for ``embedded`` the JSONL
    built (once, cached) from the target at target_dir.

    The embedded corpus lives at ``embedded_corpus_path(cache_root(cfg), target_dir, ...)``; it is
    built under a file lock, so every rank may call this at once. Raises ValueError for
    ``embedded`` without ``target_dir`` or inside a list.
    """
    if cfg.path != EMBEDDED:
        paths = source_paths(cfg.path)
        if EMBEDDED in paths:
            raise ValueError(f"data.path={cfg.path!r}: 'embedded' cannot be part of a list; give it alone")
        return cfg.path if isinstance(cfg.path, str) else paths
    if target_dir is None:
        raise ValueError("data.path=embedded needs the target directory: pass target_dir=cfg.target.path")
    kwargs = dict(cfg.chat_template_kwargs)
    out = embedded_corpus_path(
        cache_root(cfg), target_dir, cfg.embedded_num_prompts, cfg.embedded_max_new_tokens, cfg.seed, kwargs
    )
    build_embedded_corpus(
        Path(target_dir),
        out,
        num_prompts=cfg.embedded_num_prompts,
        max_new_tokens=cfg.embedded_max_new_tokens,
        seed=cfg.seed,
        chat_template_kwargs=kwargs,
    )
    return str(out)


def sidecar_meta_path(path: str | os.PathLike) -> Path:
    """``<file>.meta.json``: how a generated JSONL was made (regenerate, embedded corpus)."""
    p = Path(path)
    return p.with_name(p.name + ".meta.json")


def check_template_kwargs(source_path: str, template_kwargs: dict[str, Any]) -> None:
    """Raise ValueError when the source's sidecar records other ``chat_template_kwargs`` than
    ``template_kwargs`` (``data.chat_template_kwargs``): responses generated with thinking off
    and trained with thinking on (or the reverse) teach the drafter text the served target does
    not write."""
    meta_path = sidecar_meta_path(source_path)
    if not meta_path.is_file():
        return
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return
    generated = meta.get("chat_template_kwargs") if isinstance(meta, dict) else None
    if generated is None or dict(generated) == dict(template_kwargs):
        return
    fix = ",".join(f"{k}:{json.dumps(v)}" for k, v in sorted(generated.items()))
    raise ValueError(
        f"data.chat_template_kwargs={dict(template_kwargs)} but data.path={source_path!r} was generated "
        f"with chat_template_kwargs={dict(generated)} ({meta_path}); the training text must be rendered "
        f"as the target is served: set data.chat_template_kwargs={{{fix}}} (and serve with the same)"
    )


def split_ranges(num_records: int, num_samples: int | None, num_eval: int | None) -> tuple[range, range]:
    """(training record range, held-out eval record range) of a source with num_records records
    (``num_eval`` None: a DataConfig built without ``to_config``'s defaults; nothing held out)."""
    num_eval = num_eval or 0
    if num_eval < 0:
        raise ValueError(f"data.num_eval_prompts={num_eval} must be >= 0")
    if num_records == 0:
        raise ValueError("data.path has no records; set data.path to a non-empty JSONL or dataset")
    if num_eval >= num_records:
        raise ValueError(
            f"data.num_eval_prompts={num_eval} leaves no training conversation in a source of "
            f"{num_records}; set data.num_eval_prompts below {num_records}"
        )
    n_train = num_records - num_eval
    if num_samples is not None:
        if num_samples < 1:
            raise ValueError(f"data.num_samples={num_samples} must be >= 1 (or null for all)")
        n_train = min(n_train, num_samples)
    return range(0, n_train), range(num_records - num_eval, num_records)


def load_eval_conversations(cfg: Any, *, target_dir: str | os.PathLike | None = None) -> list[list[dict]]:
    """The held-out tail (the last ``cfg.num_eval_prompts`` records) as parsed message lists.

    Malformed records of the tail are dropped (logged). Never overlaps the training records.
    ``target_dir`` is needed for ``data.path=embedded`` only.
    """
    if not cfg.num_eval_prompts:
        return []
    source = Source(resolve_source(cfg, target_dir), cfg.split)
    _, held_out = split_ranges(source.num_records, cfg.num_samples, cfg.num_eval_prompts)
    out: list[list[dict]] = []
    for idx, rec in enumerate(source.records()):
        if idx in held_out:
            try:
                out.append(parse_messages(rec))
            except MalformedConversation as exc:
                log.warning("eval record %d skipped: %s", idx, exc)
    return out

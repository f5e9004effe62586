"""The packet wire protocol: header, payload table, encode/decode/validate. No process group here.

Data channel, target -> drafter, per packet g: one int64 header of ``HEADER_LEN`` values (the
fields of :class:`Header`, then spare zeros), then the payload tensors of :data:`PAYLOAD`, in that
order, padding removed. Both are tables: the sender (:func:`payload_tensors`, :func:`check_packet`),
the receiver (:func:`payload_buffers`, :func:`packet_from_payload`) and the docstrings of
:class:`Header` and :class:`Packet` are all built from them, so the wire order lives in one place.

An END header (kind END, no payload) closes a link after the drafter asked it to STOP. A packet
whose samples the target all dropped (non-finite hidden states, or each alone too large for its
memory) is a DATA header with T = S = 0 and num_skipped_nonfinite + num_skipped_oom > 0, and no
payload.

Control channel, drafter -> target (a separate 2-rank process group per link, so that on NCCL a
pending control receive never sits on the same stream in front of a data send): int64
[CONTROL_LEN] = [kind, g, flags, 0], kind ACK=1 (packet g consumed) or STOP=2 (stop producing,
send END); flags CTRL_FLAG_STEPPED: the drafter has finished a step (its first one includes
loading and compiling, so the target waits with the initial timeout until it sees this flag).

The receiver checks every header field before it posts the payload receives: gloo silently
reinterprets a wrong dtype and aborts the whole process when a buffer is too small, and NCCL
needs exact sizes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

PROTOCOL_VERSION = 2
HEADER_LEN = 16
CONTROL_LEN = 4

KIND_DATA = 1
KIND_END = 2
CTRL_ACK = 1
CTRL_STOP = 2
CTRL_FLAG_STEPPED = 1

FLAGS_MASK = 0xFFFF
"""Bits a sender may set in ``flags``; the rest are reserved and must be 0."""
FLAG_STOP_REQUESTED = 1 << 0
"""The target got a stop signal and asks the drafters to stop (with a checkpoint) at the next step."""

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
KIND_NAMES = {KIND_DATA: "DATA", KIND_END: "END"}
CTRL_NAMES = {CTRL_ACK: "ACK", CTRL_STOP: "STOP"}


class ProtocolError(ValueError):
    """A header or payload that does not match what the receiver expects (names field, values, sender)."""


# ----------------------------------------------------------------------------------------------
# The two tables: header fields and payload fields


HEADER_DOC: dict[str, str] = {
    "version": "PROTOCOL_VERSION",
    "kind": "DATA=1, END=2",
    "g": "global packet index (END: the next index the link would have carried)",
    "num_seqs": "S (END: 0)",
    "total_tokens": "T (END: 0)",
    "n_tap": "number of tapped layers",
    "hidden_size": "H",
    "dtype": "DTYPE_CODES of the hidden-state dtype",
    "flags": "bits 0..15 (FLAG_STOP_REQUESTED = 1); higher bits 0",
    "forward_us": "target forward time, microseconds",
    "peak_mem_bytes": "target peak memory",
    "num_skipped_nonfinite": "samples the target dropped for non-finite hidden states",
    "num_skipped_oom": "samples the target dropped because one alone did not fit its memory",
    "oom_splits": "times the target split this packet's forward after running out of memory",
}
"""The header fields in wire order (int64 each), then spare zeros up to HEADER_LEN."""


@dataclass(frozen=True)
class PayloadField:
    """One payload tensor: its name on :class:`Packet`, dtype (None = the hidden-state dtype) and shape."""

    name: str
    dtype: torch.dtype | None
    dims: tuple[str, ...]
    """Symbols: T tokens, S sequences, H hidden size, NH = n_tap * H."""
    doc: str


PAYLOAD: tuple[PayloadField, ...] = (
    PayloadField("input_ids", torch.int64, ("T",), "token ids of the packed sequences"),
    PayloadField("loss_mask", torch.uint8, ("T",), "1 on supervised (assistant) tokens"),
    PayloadField("seq_lens", torch.int64, ("S",), "length of each packed sequence"),
    PayloadField("sample_ids", torch.int64, ("S",), "source record index of each sequence"),
    PayloadField("aux_hidden", None, ("T", "NH"), "tapped target layers, concatenated"),
    PayloadField("final_hidden", None, ("T", "H"), "target final hidden state (post norm)"),
)
"""The payload in wire order (every tensor contiguous, on the link's device)."""


def _header_doc() -> str:
    rows = [f"    {i:2d} {name:<22} {doc}" for i, (name, doc) in enumerate(HEADER_DOC.items())]
    rows.append(f"    {len(HEADER_DOC):2d}..{HEADER_LEN - 1:<2d} spare                0")
    return "\n".join(rows)


def _payload_doc() -> str:
    return "\n".join(
        f"    {f.name:<13} {str(f.dtype or 'hidden dtype').removeprefix('torch.'):<13}"
        f"[{', '.join(f.dims)}]  {f.doc}"
        for f in PAYLOAD
    )


@dataclass(frozen=True)
class Header:
    version: int
    kind: int
    g: int
    num_seqs: int
    total_tokens: int
    n_tap: int
    hidden_size: int
    dtype: int
    flags: int
    forward_us: int
    peak_mem_bytes: int
    num_skipped_nonfinite: int
    num_skipped_oom: int
    oom_splits: int
    spare: tuple[int, ...] = (0,) * (HEADER_LEN - len(HEADER_DOC))

    @property
    def num_skipped(self) -> int:
        return self.num_skipped_nonfinite + self.num_skipped_oom

    @property
    def torch_dtype(self) -> torch.dtype:
        return CODE_DTYPES[self.dtype]


HEADER_FIELDS = tuple(HEADER_DOC)
NUM_SPARE = HEADER_LEN - len(HEADER_FIELDS)
Header.__doc__ = (
    f"One packet header. Wire form: int64 [{HEADER_LEN}] (index, field, meaning):\n\n{_header_doc()}\n"
)


@dataclass(frozen=True)
class HostFields:
    """A packet's small payload fields on the host: what the receiver checks and the drafter's
    bookkeeping reads (anchors, the ledger), so none of it reads the device tensor by tensor."""

    seq_lens: Tensor
    """CPU int64 [S]"""
    sample_ids: Tensor
    """CPU int64 [S]"""
    loss_mask: Tensor
    """CPU uint8 [T]"""


@dataclass
class Packet:
    index: int
    input_ids: Tensor
    loss_mask: Tensor
    seq_lens: Tensor
    sample_ids: Tensor
    aux_hidden: Tensor
    final_hidden: Tensor
    forward_s: float = 0.0
    peak_mem_bytes: int = 0
    flags: int = 0
    num_skipped_nonfinite: int = 0
    num_skipped_oom: int = 0
    """Samples dropped because a forward of that sample alone ran out of memory."""
    oom_splits: int = 0
    """Times this packet's forward was split after running out of memory."""
    host: HostFields | None = None
    """The small payload fields on the host (``host_fields``), once read."""

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.numel())

    @property
    def num_skipped(self) -> int:
        return self.num_skipped_nonfinite + self.num_skipped_oom

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


Packet.__doc__ = (
    "One packet g: the payload tensors of PAYLOAD (wire order), then what its header carries.\n\n"
    f"{_payload_doc()}\n"
)
# The tables are the single source of the wire order: the dataclasses must follow them.
assert tuple(f.name for f in dataclasses.fields(Header))[: len(HEADER_FIELDS)] == HEADER_FIELDS
assert tuple(f.name for f in dataclasses.fields(Packet))[1 : 1 + len(PAYLOAD)] == tuple(
    f.name for f in PAYLOAD
)


@dataclass(frozen=True)
class PacketSpec:
    """What both ends of a link agree on, from the config: checked on every packet."""

    num_taps: int
    hidden_size: int
    dtype: torch.dtype
    max_tokens: int
    device: torch.device

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"packet dtype {self.dtype} not supported; use one of {list(DTYPE_CODES)}")
        if self.num_taps < 1 or self.hidden_size < 1 or self.max_tokens < 1:
            raise ValueError(f"invalid PacketSpec {self}")


# ----------------------------------------------------------------------------------------------
# Encode, decode, validate


def encode_header(header: Header) -> Tensor:
    """Header -> int64 [HEADER_LEN] (CPU)."""
    values = [int(getattr(header, name)) for name in HEADER_FIELDS] + [int(x) for x in header.spare]
    if len(values) != HEADER_LEN:
        raise ValueError(f"header has {len(values)} fields, expected {HEADER_LEN}")
    return torch.tensor(values, dtype=torch.int64)


def decode_header(t: Tensor | list[int]) -> Header:
    """int64 [HEADER_LEN] -> Header (no validation)."""
    values = [int(x) for x in (t.tolist() if isinstance(t, Tensor) else t)]
    if len(values) != HEADER_LEN:
        raise ProtocolError(f"packet header has {len(values)} fields, expected {HEADER_LEN}")
    named = dict(zip(HEADER_FIELDS, values[: len(HEADER_FIELDS)], strict=True))
    return Header(**named, spare=tuple(values[len(HEADER_FIELDS) :]))


def data_header(packet: Packet, spec: PacketSpec) -> Header:
    return Header(
        version=PROTOCOL_VERSION,
        kind=KIND_DATA,
        g=int(packet.index),
        num_seqs=packet.num_seqs,
        total_tokens=packet.num_tokens,
        n_tap=spec.num_taps,
        hidden_size=spec.hidden_size,
        dtype=DTYPE_CODES[spec.dtype],
        flags=int(packet.flags),
        forward_us=max(0, int(round(packet.forward_s * 1e6))),
        peak_mem_bytes=int(packet.peak_mem_bytes),
        num_skipped_nonfinite=int(packet.num_skipped_nonfinite),
        num_skipped_oom=int(packet.num_skipped_oom),
        oom_splits=int(packet.oom_splits),
    )


def end_header(g: int, spec: PacketSpec) -> Header:
    return Header(
        version=PROTOCOL_VERSION,
        kind=KIND_END,
        g=int(g),
        num_seqs=0,
        total_tokens=0,
        n_tap=spec.num_taps,
        hidden_size=spec.hidden_size,
        dtype=DTYPE_CODES[spec.dtype],
        flags=0,
        forward_us=0,
        peak_mem_bytes=0,
        num_skipped_nonfinite=0,
        num_skipped_oom=0,
        oom_splits=0,
    )


def _fmt_kind(k: int) -> str:
    return f"{KIND_NAMES[k]}({k})" if k in KIND_NAMES else str(k)


def validate_header(
    header: Header | Tensor, *, expect_g: int, spec: PacketSpec, sender: str = "peer", allow_end: bool = False
) -> Header:
    """Check every field against the receiver's expectations; ``ProtocolError`` names the first bad one."""
    h = decode_header(header) if isinstance(header, Tensor) else header

    def fail(field: str, expected, got) -> ProtocolError:
        return ProtocolError(
            f"packet header from {sender}: field {field} expected {expected}, got {got} (expected packet {expect_g})"
        )

    if h.version != PROTOCOL_VERSION:
        raise fail("version", PROTOCOL_VERSION, h.version)
    kinds = (KIND_DATA, KIND_END) if allow_end else (KIND_DATA,)
    if h.kind not in kinds:
        raise fail("kind", " or ".join(_fmt_kind(k) for k in kinds), _fmt_kind(h.kind))
    if h.g != expect_g:
        raise fail("g", expect_g, h.g)
    if h.n_tap != spec.num_taps:
        raise fail("n_tap", spec.num_taps, h.n_tap)
    if h.hidden_size != spec.hidden_size:
        raise fail("hidden_size", spec.hidden_size, h.hidden_size)
    code = DTYPE_CODES[spec.dtype]
    if h.dtype != code:
        got = f"{h.dtype} ({CODE_DTYPES[h.dtype]})" if h.dtype in CODE_DTYPES else h.dtype
        raise fail("dtype", f"{code} ({spec.dtype})", got)
    if h.kind == KIND_END:
        if h.total_tokens != 0:
            raise fail("total_tokens", "0 for END", h.total_tokens)
        if h.num_seqs != 0:
            raise fail("num_seqs", "0 for END", h.num_seqs)
    elif h.total_tokens == 0 and h.num_skipped > 0:  # every sample dropped: an empty packet
        if h.num_seqs != 0:
            raise fail("num_seqs", "0 (empty packet)", h.num_seqs)
    else:
        if not 0 < h.total_tokens <= spec.max_tokens:
            raise fail(
                "total_tokens",
                f"1..{spec.max_tokens} (0 only with num_skipped_nonfinite or num_skipped_oom > 0)",
                h.total_tokens,
            )
        if not 0 < h.num_seqs <= h.total_tokens:
            raise fail("num_seqs", f"1..{h.total_tokens} (total_tokens)", h.num_seqs)
    if h.flags < 0 or h.flags & ~FLAGS_MASK:
        raise fail("flags", f"bits within {FLAGS_MASK:#x}", h.flags)
    for name in ("forward_us", "peak_mem_bytes"):
        if getattr(h, name) < 0:
            raise fail(name, ">= 0", getattr(h, name))
    for name in ("num_skipped_nonfinite", "num_skipped_oom", "oom_splits"):
        if getattr(h, name) < 0:
            raise fail(name, ">= 0", getattr(h, name))
    for i, v in enumerate(h.spare):
        if v != 0:
            raise fail(f"spare{len(HEADER_FIELDS) + i}", 0, v)
    return h


def payload_buffers(h: Header, device: torch.device) -> list[Tensor]:
    """Empty receive buffers for the payload of DATA header ``h``, in wire order (:data:`PAYLOAD`)."""
    return [torch.empty(payload_shape(f, h), dtype=f.dtype or h.torch_dtype, device=device) for f in PAYLOAD]


def packet_from_payload(h: Header, tensors: list[Tensor]) -> Packet:
    """The packet of DATA header ``h`` and its received payload (wire order)."""
    payload: dict[str, Any] = {f.name: t for f, t in zip(PAYLOAD, tensors, strict=True)}
    return Packet(
        index=h.g,
        **payload,
        forward_s=h.forward_us / 1e6,
        peak_mem_bytes=h.peak_mem_bytes,
        flags=h.flags,
        num_skipped_nonfinite=h.num_skipped_nonfinite,
        num_skipped_oom=h.num_skipped_oom,
        oom_splits=h.oom_splits,
    )


def payload_shape(f: PayloadField, h: Header) -> tuple[int, ...]:
    """The shape of payload field ``f`` in the packet of header ``h``."""
    sizes = {"T": h.total_tokens, "S": h.num_seqs, "H": h.hidden_size, "NH": h.n_tap * h.hidden_size}
    return tuple(sizes[d] for d in f.dims)


def host_fields(packet: Packet) -> HostFields:
    """``packet.host``, read once: one device-to-host copy of seq_lens, sample_ids and loss_mask
    together (none when they are on the CPU already)."""
    if packet.host is None:
        small = (packet.seq_lens, packet.sample_ids, packet.loss_mask)
        if all(t.device.type == "cpu" for t in small):
            packet.host = HostFields(*small)
        elif packet.num_tokens == 0:  # every sample dropped: nothing to read
            packet.host = HostFields(*(torch.zeros(0, dtype=t.dtype) for t in small))
        else:
            s = packet.num_seqs
            flat = torch.cat([packet.seq_lens, packet.sample_ids, packet.loss_mask.long()]).cpu()
            packet.host = HostFields(flat[:s], flat[s : 2 * s], flat[2 * s :].to(torch.uint8))
    return packet.host


def validate_payload(
    h: Header, seq_lens: Tensor, sample_ids: Tensor, loss_mask: Tensor, *, sender: str = "peer"
) -> None:
    """Payload consistency: sum(seq_lens) == total_tokens, lengths > 0, ids >= 0, mask in {0, 1}
    (host work on the CPU tensors of ``host_fields``)."""
    where = f"packet {h.g} payload from {sender}"
    total = int(seq_lens.sum().item())
    if total != h.total_tokens:
        raise ProtocolError(
            f"{where}: field sum(seq_lens) expected {h.total_tokens} (total_tokens), got {total}"
        )
    if h.num_seqs and int(seq_lens.min().item()) < 1:
        raise ProtocolError(f"{where}: field seq_lens expected all >= 1, got {seq_lens.tolist()}")
    if h.num_seqs and int(sample_ids.min().item()) < 0:
        raise ProtocolError(
            f"{where}: field sample_ids expected all >= 0, got min {int(sample_ids.min().item())}"
        )
    if h.total_tokens and int(loss_mask.max().item()) > 1:
        raise ProtocolError(
            f"{where}: field loss_mask expected values in {{0, 1}}, got max {int(loss_mask.max().item())}"
        )


def check_packet(packet: Packet, spec: PacketSpec) -> None:
    """Sender-side shape/dtype checks (a bug on the target, reported before anything is sent)."""
    t, s = packet.num_tokens, packet.num_seqs
    expect = data_header(packet, spec)
    problems = []
    for f in PAYLOAD:
        x = getattr(packet, f.name)
        dtype, shape = f.dtype or spec.dtype, payload_shape(f, expect)
        if x.dtype != dtype or tuple(x.shape) != shape:
            problems.append(f"{f.name} must be {dtype} {list(shape)}, got {x.dtype} {list(x.shape)}")
    if t == 0 and s == 0 and packet.num_skipped > 0:
        pass  # every sample was dropped: a valid empty packet (header only)
    elif not 0 < t <= spec.max_tokens:
        problems.append(f"total tokens {t} outside 1..{spec.max_tokens} (0 only when samples were skipped)")
    elif not 0 < s <= t:
        problems.append(f"num_seqs {s} outside 1..{t}")
    elif not problems and int(packet.seq_lens.sum().item()) != t:
        problems.append(f"sum(seq_lens)={int(packet.seq_lens.sum().item())} != {t} tokens")
    for name in ("num_skipped_nonfinite", "num_skipped_oom", "oom_splits"):
        if getattr(packet, name) < 0:
            problems.append(f"{name} {getattr(packet, name)} < 0")
    if packet.flags < 0 or packet.flags & ~FLAGS_MASK:
        problems.append(f"flags {packet.flags} outside {FLAGS_MASK:#x}")
    if problems:
        raise ValueError(f"packet {packet.index} is malformed: " + "; ".join(problems))


def payload_tensors(packet: Packet, device: torch.device) -> list[Tensor]:
    """The payload in wire order (:data:`PAYLOAD`), contiguous and on ``device``."""
    return [getattr(packet, f.name).to(device, non_blocking=True).contiguous() for f in PAYLOAD]


def encode_control(kind: int, g: int, flags: int = 0) -> Tensor:
    """A control message (ACK or STOP of packet g, ``flags`` 0 or CTRL_FLAG_STEPPED), int64 [CONTROL_LEN]."""
    return torch.tensor([kind, g, flags, 0], dtype=torch.int64)

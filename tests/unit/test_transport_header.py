"""Wire protocol pieces that need no process group: header layout, validation, payload checks, naming."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dflash.distributed.links import Endpoint, PeerError
from dflash.distributed.protocol import (
    DTYPE_CODES,
    FLAG_STOP_REQUESTED,
    FLAGS_MASK,
    HEADER_FIELDS,
    HEADER_LEN,
    KIND_DATA,
    KIND_END,
    PROTOCOL_VERSION,
    Header,
    Packet,
    PacketSpec,
    ProtocolError,
    check_packet,
    data_header,
    decode_header,
    encode_header,
    end_header,
    validate_header,
    validate_payload,
)
from dflash.distributed.topology import Topology, first_on_link, link_period, linked_drafters, linked_targets

SPEC = PacketSpec(
    num_taps=5, hidden_size=4096, dtype=torch.bfloat16, max_tokens=16384, device=torch.device("cpu")
)
SENDER = "target 1 (rank 1)"


def packet(g=7, lens=(3, 5), hidden=8, taps=2, dtype=torch.float32) -> Packet:
    t = sum(lens)
    return Packet(
        index=g,
        input_ids=torch.arange(t),
        loss_mask=torch.ones(t, dtype=torch.uint8),
        seq_lens=torch.tensor(lens, dtype=torch.long),
        sample_ids=torch.arange(len(lens)),
        aux_hidden=torch.zeros(t, taps * hidden, dtype=dtype),
        final_hidden=torch.zeros(t, hidden, dtype=dtype),
        forward_s=1.25,
        peak_mem_bytes=2**33,
        flags=3,
        num_skipped_nonfinite=2,
        num_skipped_oom=1,
        oom_splits=3,
    )


def good_header(**changes) -> Header:
    h = Header(
        version=PROTOCOL_VERSION,
        kind=KIND_DATA,
        g=7,
        num_seqs=3,
        total_tokens=1000,
        n_tap=5,
        hidden_size=4096,
        dtype=DTYPE_CODES[torch.bfloat16],
        flags=0,
        forward_us=1500,
        peak_mem_bytes=10**10,
        num_skipped_nonfinite=1,
        num_skipped_oom=2,
        oom_splits=5,
    )
    return dataclasses.replace(h, **changes)


def test_layout_is_fixed():
    assert HEADER_LEN == 16
    assert HEADER_FIELDS == (
        "version",
        "kind",
        "g",
        "num_seqs",
        "total_tokens",
        "n_tap",
        "hidden_size",
        "dtype",
        "flags",
        "forward_us",
        "peak_mem_bytes",
        "num_skipped_nonfinite",
        "num_skipped_oom",
        "oom_splits",
    )
    t = encode_header(good_header())
    assert t.dtype == torch.int64 and t.shape == (16,)
    assert t.tolist() == [PROTOCOL_VERSION, 1, 7, 3, 1000, 5, 4096, 2, 0, 1500, 10**10, 1, 2, 5, 0, 0]


def test_round_trip():
    spec = PacketSpec(
        num_taps=2, hidden_size=8, dtype=torch.float32, max_tokens=64, device=torch.device("cpu")
    )
    h = data_header(packet(), spec)
    back = decode_header(encode_header(h))
    assert back == h
    assert (back.g, back.num_seqs, back.total_tokens, back.n_tap, back.hidden_size) == (7, 2, 8, 2, 8)
    assert (back.forward_us, back.peak_mem_bytes, back.flags, back.num_skipped_nonfinite) == (
        1_250_000,
        2**33,
        3,
        2,
    )
    assert back.torch_dtype == torch.float32
    assert validate_header(encode_header(h), expect_g=7, spec=spec, sender=SENDER) == h
    end = end_header(9, spec)
    assert decode_header(encode_header(end)) == end
    assert validate_header(end, expect_g=9, spec=spec, allow_end=True).kind == KIND_END


BAD = [
    ("version", {"version": 1}, "expected 2, got 1"),
    ("kind", {"kind": 3}, "expected DATA(1), got 3"),
    ("kind", {"kind": KIND_END, "num_seqs": 0, "total_tokens": 0}, "expected DATA(1), got END(2)"),
    ("g", {"g": 8}, "expected 7, got 8"),
    ("n_tap", {"n_tap": 4}, "expected 5, got 4"),
    ("hidden_size", {"hidden_size": 2048}, "expected 4096, got 2048"),
    ("dtype", {"dtype": DTYPE_CODES[torch.float32]}, "expected 2 (torch.bfloat16), got 1 (torch.float32)"),
    ("dtype", {"dtype": 99}, "got 99"),
    (
        "total_tokens",
        {"total_tokens": 0, "num_skipped_nonfinite": 0, "num_skipped_oom": 0},
        "expected 1..16384 (0 only with",
    ),
    ("total_tokens", {"total_tokens": 16385}, "got 16385"),
    ("num_seqs", {"total_tokens": 0, "num_seqs": 2}, "expected 0 (empty packet), got 2"),
    ("num_seqs", {"num_seqs": 0}, "got 0"),
    ("num_seqs", {"num_seqs": 1001}, "expected 1..1000 (total_tokens), got 1001"),
    ("flags", {"flags": 1 << 20}, f"got {1 << 20}"),
    ("flags", {"flags": -1}, "got -1"),
    ("forward_us", {"forward_us": -5}, "expected >= 0, got -5"),
    ("peak_mem_bytes", {"peak_mem_bytes": -1}, "got -1"),
    ("num_skipped_nonfinite", {"num_skipped_nonfinite": -1}, "got -1"),
    ("num_skipped_oom", {"num_skipped_oom": -1}, "got -1"),
    ("oom_splits", {"oom_splits": -2}, "got -2"),
    *[
        (f"spare{i}", {"spare": tuple(7 if j == i - 14 else 0 for j in range(2))}, "expected 0, got 7")
        for i in range(14, 16)
    ],
]


@pytest.mark.parametrize("field,changes,detail", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_every_field_is_checked(field, changes, detail):
    with pytest.raises(ProtocolError) as info:
        validate_header(encode_header(good_header(**changes)), expect_g=7, spec=SPEC, sender=SENDER)
    msg = str(info.value)
    assert msg.startswith(f"packet header from {SENDER}: field {field} expected"), msg
    assert detail in msg
    assert isinstance(info.value, ValueError)


def test_end_header_rules():
    end = good_header(kind=KIND_END, num_seqs=0, total_tokens=0)
    assert validate_header(end, expect_g=7, spec=SPEC, allow_end=True).kind == KIND_END
    with pytest.raises(ProtocolError, match="field total_tokens expected 0 for END, got 5"):
        validate_header(dataclasses.replace(end, total_tokens=5), expect_g=7, spec=SPEC, allow_end=True)
    with pytest.raises(ProtocolError, match="field g expected 9, got 7"):
        validate_header(end, expect_g=9, spec=SPEC, allow_end=True)


def test_empty_packet_only_when_samples_were_skipped():
    """A target that dropped every sample of a packet (non-finite hidden states, or each alone too
    large for its memory) sends a header only."""
    empty = good_header(num_seqs=0, total_tokens=0, num_skipped_nonfinite=4, num_skipped_oom=0)
    assert validate_header(empty, expect_g=7, spec=SPEC).total_tokens == 0
    too_big = good_header(num_seqs=0, total_tokens=0, num_skipped_nonfinite=0, num_skipped_oom=2)
    assert validate_header(too_big, expect_g=7, spec=SPEC).total_tokens == 0
    spec = PacketSpec(
        num_taps=2, hidden_size=8, dtype=torch.float32, max_tokens=64, device=torch.device("cpu")
    )
    p = packet(lens=())
    p.num_skipped_nonfinite, p.num_skipped_oom = 3, 0
    check_packet(p, spec)
    p.num_skipped_nonfinite = 0
    with pytest.raises(ValueError, match="0 only when samples were skipped"):
        check_packet(p, spec)
    assert FLAG_STOP_REQUESTED == 1 and FLAG_STOP_REQUESTED & FLAGS_MASK


def test_wrong_length_header():
    with pytest.raises(ProtocolError, match="12 fields, expected 16"):
        decode_header(torch.zeros(12, dtype=torch.int64))


def test_payload_consistency():
    h = good_header(num_seqs=2, total_tokens=8)
    validate_payload(
        h, torch.tensor([3, 5]), torch.tensor([0, 1]), torch.ones(8, dtype=torch.uint8), sender=SENDER
    )
    with pytest.raises(ProtocolError, match=r"field sum\(seq_lens\) expected 8 \(total_tokens\), got 7"):
        validate_payload(
            h, torch.tensor([3, 4]), torch.tensor([0, 1]), torch.ones(8, dtype=torch.uint8), sender=SENDER
        )
    with pytest.raises(ProtocolError, match="field seq_lens"):
        validate_payload(h, torch.tensor([8, 0]), torch.tensor([0, 1]), torch.ones(8, dtype=torch.uint8))
    with pytest.raises(ProtocolError, match="field loss_mask"):
        validate_payload(
            h, torch.tensor([3, 5]), torch.tensor([0, 1]), torch.full((8,), 2, dtype=torch.uint8)
        )


def test_sender_side_packet_checks():
    spec = PacketSpec(
        num_taps=2, hidden_size=8, dtype=torch.float32, max_tokens=64, device=torch.device("cpu")
    )
    check_packet(packet(), spec)
    with pytest.raises(ValueError, match="aux_hidden must be torch.float32"):
        check_packet(packet(dtype=torch.bfloat16), spec)
    with pytest.raises(ValueError, match="final_hidden must be"):
        check_packet(packet(hidden=16), spec)
    p = packet()
    p.seq_lens = torch.tensor([3, 4])
    with pytest.raises(ValueError, match=r"sum\(seq_lens\)=7 != 8"):
        check_packet(p, spec)
    with pytest.raises(ValueError, match="outside 1..4"):
        check_packet(packet(), dataclasses.replace(spec, max_tokens=4))
    with pytest.raises(ValueError, match="not supported"):
        dataclasses.replace(spec, dtype=torch.int32)


def test_link_schedule():
    topo = Topology(2, 1, 3)
    assert link_period(topo) == 2 and first_on_link(topo, 1, 2, 0) == 1 and first_on_link(topo, 0, 2, 5) == 6
    six_two = Topology(6, 2, 8)  # gcd 2: target 0 only ever feeds drafter 0 (rank 6)
    assert linked_drafters(six_two, 0) == [6] and linked_drafters(six_two, 1) == [7]
    assert linked_targets(six_two, 7) == [1, 3, 5]
    three_two = Topology(3, 2, 5)
    assert linked_drafters(three_two, 0) == [3, 4] and first_on_link(three_two, 0, 4, 0) == 3


def test_peer_error_names_both_sides():
    ep = Endpoint(Topology(2, 1, 3), 2, 120.0, torch.device("cpu"))
    e = ep._peer_error(1, "recv header", 7, 120.0, None)
    assert isinstance(e, PeerError) and str(e) == (
        "drafter 0 (rank 2): no packet header from target 1 (rank 1) for packet 7 within 120s (recv header); "
        "the target is dead or stuck"
    )
    closed = RuntimeError(
        "[/x/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1. This is typically caused"
    )
    e = ep._peer_error(0, "recv payload", 4, 30.0, closed)
    assert str(e) == (
        "drafter 0 (rank 2): recv payload with target 0 (rank 0) for packet 4 failed "
        "(Connection closed by peer [127.0.0.1]:1; timeout 30s); the target died or its connection broke"
    )
    t = Endpoint(Topology(2, 1, 3), 0, 5.0, torch.device("cpu"))
    assert str(t._peer_error(2, "recv ACK", None, 5.0, RuntimeError("Timed out waiting 5000ms"))) == (
        "target 0 (rank 0): no ACK from drafter 0 (rank 2) within 5s (recv ACK); the drafter is dead or stuck"
    )


def test_device_and_backend_resolution(monkeypatch):
    from dflash.config import TopologyConfig
    from dflash.config.resolve import resolve_device
    from dflash.distributed.process_group import init_distributed, resolve_backend

    cpu = torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto", 0) == cpu
        with pytest.raises(ValueError, match="topology.device=cuda"):
            resolve_device("cuda", 0)
    assert resolve_backend(TopologyConfig(backend="auto"), cpu) == "gloo"
    assert resolve_backend(TopologyConfig(backend="auto"), torch.device("cuda", 0)) == "nccl"
    with pytest.raises(ValueError, match="topology.backend=nccl"):
        resolve_backend(TopologyConfig(backend="nccl"), cpu)
    with pytest.raises(ValueError, match="topology.backend=gloo"):
        resolve_backend(TopologyConfig(backend="gloo"), torch.device("cuda", 0))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="torchrun"):
        init_distributed(TopologyConfig())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        ValueError, match="WORLD_SIZE=4"
    ):  # 2 targets + 1 drafter != 4, before any group exists
        init_distributed(TopologyConfig(num_targets=2, num_drafters=1))

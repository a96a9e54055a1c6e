"""The wire protocol: framing, signing, replay rejection; the fork-server framing."""

from __future__ import annotations

import pytest

from monarch_worker import protocol as P
from monarch_worker.serialize import dumps, loads

KEY = b"k" * 32


def test_roundtrip_with_payload_and_buffers() -> None:
    tx, rx = P.Signer(KEY), P.Signer(KEY)
    payload, buffers = dumps({"a": bytearray(200_000)})
    frames = tx.pack(P.Exec(7, "x = 1", "<cell>", {"f": "src"}), payload, buffers)
    msg, pl, bufs = rx.unpack(frames)
    assert msg == P.Exec(7, "x = 1", "<cell>", {"f": "src"})
    assert loads(pl, bufs) == {"a": bytearray(200_000)}


def test_wrong_secret_is_rejected_before_parsing() -> None:
    frames = P.Signer(b"x" * 32).pack(P.Ping())
    with pytest.raises(P.ProtocolError, match="bad signature"):
        P.Signer(KEY).unpack(frames)


def test_tampered_header_or_buffer_size_is_rejected() -> None:
    tx = P.Signer(KEY)
    frames = tx.pack(P.Result(1, "ok"), b"", [b"abc"])
    bad = list(frames)
    header = bytes(bad[2])
    assert b"ok" in header
    bad[2] = header.replace(b"ok", b"no")  # the status field, changed in place
    with pytest.raises(P.ProtocolError):
        P.Signer(KEY).unpack(bad)
    bad = list(frames)
    bad[4] = b"abcd"
    with pytest.raises(P.ProtocolError):
        P.Signer(KEY).unpack(bad)


def test_replay_is_rejected() -> None:
    tx, rx = P.Signer(KEY), P.Signer(KEY)
    frames = tx.pack(P.Ping())
    rx.unpack(frames)
    with pytest.raises(P.ProtocolError, match="replayed"):
        rx.unpack(frames)


def test_garbage_is_rejected() -> None:
    rx = P.Signer(KEY)
    for frames in ([b"hello"], [b"a", b"b", b"c", b"d"], [P.MAGIC, b"", b"{}", b""]):
        with pytest.raises(P.ProtocolError):
            rx.unpack(frames)


def test_every_message_type_registered_once() -> None:
    assert len(P.MESSAGE_TYPES) == len(set(P.MESSAGE_TYPES.values()))
    for name, cls in P.MESSAGE_TYPES.items():
        assert cls.TYPE == name


def test_short_secret_refused() -> None:
    with pytest.raises(ValueError):
        P.Signer(b"short")


def test_fork_server_frame() -> None:
    frame = P.fork_server_json(P.FS_SPAWNED, 3, {"pid": 42})
    kind, sid, n = P.FORK_SERVER_HEADER.unpack_from(frame)
    assert (kind, sid, frame[P.FORK_SERVER_HEADER.size:]) == (P.FS_SPAWNED, 3, b'{"pid": 42}')
    assert n == len(b'{"pid": 42}')


def test_message_names_are_listed_once_and_match_the_registry() -> None:
    """Each message class is named in its own module's __all__ and nowhere else: the protocol re-exports those, and
    every registered type is there (issue 25: the names were listed three times)."""
    from monarch_worker import dapmessages, hostmessages, messages

    names = messages.__all__ + hostmessages.__all__ + dapmessages.__all__
    listed = {n for n in names if isinstance(getattr(P, n, None), type)
              and issubclass(getattr(P, n), P.Message) and n != "Message"}
    assert listed == {cls.__name__ for cls in P.MESSAGE_TYPES.values()}
    assert set(names) <= set(P.__all__)
    # What a message's declaration says routes it: records and work are derived from it.
    assert {c.TYPE for c in P.record_types()} == {"result", "progress", "debug_output", "debug_prompt",
                                                  "debug_resumed", "display"}
    assert all(c.ROUTE for c in P.record_types())
    assert {c.TYPE for c in P.work_types()} == {"exec", "call", "push", "pull", "debug_post_mortem", "shutdown"}

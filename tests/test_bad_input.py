"""Every bad input a user can type is a one-line error naming the value and the fix, raised
before any work (no traceback, no megabyte echo of a bad line)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megatron_bytescale import cli
from megatron_bytescale.data.ray_loader import check_reachable
from megatron_bytescale.errors import ConfigError
from megatron_bytescale.local_world import free_port

PROFILE = Path(__file__).resolve().parent.parent / "megatron_bytescale" / "configs" / "profiles" / "tiny-cpu.json"
PLAN = ["plan", "--model", "tiny", "--gpus", "4", "--capacity", "1K"]
SIM = ["simulate", "--gpus", "8", "--context", "64K", "--capacity", "8K", "--global-batch-tokens", "1M", "--steps", "1"]


def files(tmp_path):
    (tmp_path / "latin1.txt").write_bytes(b"\xff\xfe12\n")
    (tmp_path / "huge.txt").write_text("9" * 5_000_000 + "\n")
    (tmp_path / "hugex.txt").write_text("x" * 5_000_000 + "\n")
    for name, change in {"bw0": {"bw_intra_node": 0}, "nan": {"a1": float("nan")}, "inf": {"bw_d2h": "inf"}}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**json.loads(PROFILE.read_text()), **change}))
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')


CASES = [
    (PLAN[:-2] + ["--capacity", "1K", "--lengths", ""], "--lengths is empty"),
    (PLAN[:-2] + ["--capacity", "nan", "--lengths", "100"], "cannot read --capacity 'nan': write a finite number"),
    (PLAN[:-2] + ["--capacity", "inf", "--lengths", "100"], "cannot read --capacity 'inf'"),
    (PLAN + ["--lengths-file", "{d}/latin1.txt"], "latin1.txt: not UTF-8 text (byte 0)"),
    (
        PLAN + ["--lengths-file", "{d}/huge.txt"],
        "line 1: length '9999999999999999999999999999999999999999'... (5,000,000 characters) exceeds",
    ),
    (PLAN + ["--lengths-file", "{d}/hugex.txt"], "is not a whole number"),
    (PLAN + ["--lengths", "100", "--gpus-per-node", "0"], "--gpus-per-node must be positive, got 4, 1, 1, 0"),
    (
        PLAN + ["--lengths", "100", "--json", "{d}/missing/plan.json"],
        "--json {d}/missing/plan.json: folder {d}/missing does not exist",
    ),
    (PLAN + ["--lengths", "100", "--profile", "{d}/bw0.json"], "field 'bw_intra_node' must be positive, got 0"),
    (PLAN + ["--lengths", "100", "--profile", "{d}/nan.json"], "field 'a1' must be a finite number, got nan"),
    (PLAN + ["--lengths", "100", "--profile", "{d}/inf.json"], "field 'bw_d2h' must be a finite number, got inf"),
    (SIM[:8] + ["1K"], "--global-batch-tokens 1K is smaller than --context 64K"),
    (SIM + ["--gpus-per-node", "0"], "gpus_per_node must be a positive whole number, got 0"),
    (
        SIM + ["--lengths-file", "{d}/hugex.txt"],
        "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'... (5,000,000 characters) is not a whole number",
    ),
    (SIM + ["--plot", "{d}/missing/t.png"], "--plot {d}/missing/t.png: folder {d}/missing does not exist"),
    (
        ["prepare-data", "--output", "{d}/o", "--jsonl", "{d}/bad.jsonl"],
        "bad.jsonl:2: not UTF-8 text (byte 13 of the line)",
    ),
    (
        ["prepare-data", "--output", "{d}/o", "--jsonl", "{d}/bad.jsonl", "--max-file-bytes=-1"],
        "--max-file-bytes -1: give the largest",
    ),
    (
        ["dataloader-bench", "--mode", "ray", "--address", "127.0.0.1:1"],
        "--address 127.0.0.1:1: no Ray cluster answers there",
    ),
    (["profile", "--out", "{d}/missing/p.json"], "--out {d}/missing/p.json: folder {d}/missing does not exist"),
]


@pytest.mark.parametrize("argv, message", CASES)
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    files(tmp_path)
    d = str(tmp_path)
    t0 = time.monotonic()
    assert cli.main([a.format(d=d) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message.format(d=d) in err, err
    assert err.count("\n") == 1 and len(err) < 500 and "Traceback" not in err
    assert time.monotonic() - t0 < 15


def test_prepare_data_counts_non_utf8_files_apart_from_binary_ones(tmp_path, capsys):
    (tmp_path / "ok.txt").write_text("hello\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01")
    argv = ["prepare-data", "--output", str(tmp_path / "o"), "--text-files"] + [
        str(tmp_path / n) for n in ("ok.txt", "latin1.txt", "blob.bin")
    ]
    assert cli.main(argv) == 0
    assert (
        "1 text files used, 1 binary, 0 over --max-file-bytes, 1 not UTF-8 and 0 unreadable skipped"
        in capsys.readouterr().out
    )


def test_a_dead_ray_address_fails_in_seconds_naming_it():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"^--address 127.0.0.1:{port}: no Ray cluster answers there"):
        check_reachable(f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 30
    with pytest.raises(ConfigError, match="HOST:PORT"):
        check_reachable("nonsense")


def _serve_once(reply: bytes | None):
    """A TCP server on a free local port that accepts one connection and sends ``reply``
    (None: says nothing and keeps the connection open), like a service that is not Ray."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve():
        conn, _ = server.accept()
        with conn:
            if reply is not None:
                conn.sendall(reply)
            done.wait(30)
        server.close()

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1], done


@pytest.mark.parametrize(
    "reply, why",
    [
        (None, "no HTTP/2 answer within 1 s"),
        (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "not HTTP/2"),
        (b"SSH-2.0-OpenSSH_9.6\r\n", "not HTTP/2"),
    ],
)
def test_an_address_that_is_not_a_ray_head_fails_in_seconds_naming_it(reply, why):
    port, done = _serve_once(reply)
    t0 = time.monotonic()
    try:
        with pytest.raises(
            ConfigError,
            match=rf"^--address 127.0.0.1:{port}: something listens there but it is not a Ray head \(.*{why}",
        ):
            check_reachable(f"127.0.0.1:{port}", answer_timeout_s=1.0)
    finally:
        done.set()
    assert time.monotonic() - t0 < 5


def test_a_grpc_server_passes_the_ray_head_probe():
    """What a gRPC server (a Ray head's GCS) sends first: a SETTINGS frame (the real GCS is
    probed in test_data_ray)."""
    port, done = _serve_once(bytes([0, 0, 6, 4, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 100]))
    try:
        check_reachable(f"127.0.0.1:{port}", answer_timeout_s=5.0)
    finally:
        done.set()

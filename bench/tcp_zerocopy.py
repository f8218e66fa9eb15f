#!/usr/bin/env python
"""Does MSG_ZEROCOPY pay for large TCP sends here? 64 MiB one way over one stream, plain
`send` against `send(..., MSG_ZEROCOPY)`, alternated.

    python bench/tcp_zerocopy.py                      # both processes on loopback
    ip netns exec B python bench/tcp_zerocopy.py --receive 10.0.0.2   # across a veth or a NIC:
    ip netns exec A python bench/tcp_zerocopy.py --send 10.0.0.2      # the receiver first

Prints each mode's mean and best rate, and for zerocopy how many completion notices the kernel
queued and how many of them said it copied the data after all (SO_EE_CODE_ZEROCOPY_COPIED).
Results and the decision: docs/design/tcp.md, "MSG_ZEROCOPY".
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import time

SO_ZEROCOPY = getattr(socket, "SO_ZEROCOPY", 60)
MSG_ZEROCOPY = getattr(socket, "MSG_ZEROCOPY", 0x4000000)
NBYTES, CHUNK = 64 << 20, 4 << 20
MODES = (False, True, False, True)  # zerocopy off and on, alternated


def receive(lst: socket.socket, rounds: int) -> None:
    view = memoryview(bytearray(NBYTES))
    for _ in MODES:
        conn, _ = lst.accept()
        for _ in range(2 * rounds):
            got = 0
            while got < NBYTES:
                got += conn.recv_into(view[got:], NBYTES - got)
            conn.sendall(b"k")
        conn.close()


def _drain(sock: socket.socket) -> tuple[int, int]:
    """Completion notices read from the error queue: (notices, of them 'copied')."""
    notices = copied = 0
    while True:
        try:
            _, anc, _, _ = sock.recvmsg(1, 256, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return notices, copied
        notices += 1
        copied += sum(1 for _, _, data in anc if len(data) >= 8 and data[6] & 1)  # sock_extended_err.ee_code


def send(host: str, port: int, rounds: int) -> None:
    view = memoryview(bytearray(os.urandom(1024) * (NBYTES // 1024)))
    for zerocopy in MODES:
        sock = socket.create_connection((host, port))
        if zerocopy:
            sock.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
        times, notices, copied = [], 0, 0
        for r in range(2 * rounds):  # the first `rounds` warm up
            t0 = time.perf_counter()
            sent = 0
            while sent < NBYTES:
                try:
                    sent += sock.send(view[sent:sent + CHUNK], MSG_ZEROCOPY if zerocopy else 0)
                except OSError as exc:
                    if exc.errno != errno.ENOBUFS:  # too many notices pending: read them, go on
                        raise
                if zerocopy:
                    n, c = _drain(sock)
                    notices, copied = notices + n, copied + c
            sock.recv(1)
            if r >= rounds:
                times.append(time.perf_counter() - t0)
        sock.close()
        mean = sum(times) / len(times)
        print(f"{'zerocopy' if zerocopy else 'plain':8s}: mean {NBYTES / mean / 1e9:.2f} GB/s, best "
              f"{NBYTES / min(times) / 1e9:.2f} GB/s"
              + (f", {notices} notices, {copied} of them 'copied'" if zerocopy else ""), flush=True)
        time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--receive", metavar="ADDR", help="only receive, listening on ADDR")
    p.add_argument("--send", metavar="ADDR", help="only send, to ADDR")
    p.add_argument("--port", type=int, default=5901, help="with --receive/--send")
    p.add_argument("--rounds", type=int, default=8, help="timed sends a mode, after as many untimed")
    args = p.parse_args()
    if args.send:
        send(args.send, args.port, args.rounds)
        return
    lst = socket.socket()
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind((args.receive or "127.0.0.1", args.port if args.receive else 0))
    lst.listen(len(MODES))
    if args.receive:
        receive(lst, args.rounds)
        return
    pid = os.fork()
    if pid == 0:
        receive(lst, args.rounds)
        os._exit(0)
    send("127.0.0.1", lst.getsockname()[1], args.rounds)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()

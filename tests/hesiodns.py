"""A group source that does not enumerate, for tests: glibc's `hesiod` NSS module (libc6 ships
it) answers getgrgid/getgrnam from DNS TXT records and has no getgrent, as LDAP or sssd with
`enumerate = false` do not list their groups. This is the DNS server it asks: run in a private
network namespace (`unshare -n`), it brings that namespace's loopback up, answers on
127.0.0.1:53 with the TXT records given as NAME=TEXT arguments (NXDOMAIN for any other name),
and goes to the background once it listens, printing its pid.

    python3 hesiodns.py 999.gid.ns.nvhook.test='ldapers:*:999:alice' ...

The root that asks names it in its etc/resolv.conf (nameserver 127.0.0.1) and etc/hesiod.conf
(RHS below), and lists `hesiod` after `files` for group in its etc/nsswitch.conf.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys

RHS = ".nvhook.test"
NSSWITCH = "passwd: files\ngroup: files hesiod\nshadow: files\ngshadow: files\n"
HESIOD_CONF = f"lhs=.ns\nrhs={RHS}\n"
RESOLV_CONF = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"
SIOCSIFFLAGS = 0x8914
IFF_UP_LOOPBACK_RUNNING = 0x1 | 0x8 | 0x40


def records(groups: list[str]) -> list[str]:
    """NAME=TEXT arguments for group lines `name:*:gid:members`: hesiod looks a gid up as
    GID.gid.ns<RHS> and a name as NAME.group.ns<RHS>."""
    out = []
    for line in groups:
        name, _, gid = line.split(":")[:3]
        out += [f"{gid}.gid.ns{RHS}={line}", f"{name}.group.ns{RHS}={line}"]
    return out


def answer(query: bytes, table: dict[str, str]) -> bytes:
    qid = struct.unpack(">H", query[:2])[0]
    i, labels = 12, []
    while query[i]:
        labels.append(query[i + 1:i + 1 + query[i]].decode("ascii", "replace"))
        i += 1 + query[i]
    question = query[12:i + 5]
    text = table.get(".".join(labels).lower())
    if text is None:  # NXDOMAIN
        return struct.pack(">HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question
    data = text.encode()
    qclass = struct.unpack(">H", query[i + 3:i + 5])[0]
    rr = b"\xc0\x0c" + struct.pack(">HHIH", 16, qclass, 0, len(data) + 1) + bytes([len(data)]) + data
    return struct.pack(">HHHHHH", qid, 0x8580, 1, 1, 0, 0) + question + rr


def main() -> None:
    table = dict(a.split("=", 1) for a in sys.argv[1:])
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH", b"lo", IFF_UP_LOOPBACK_RUNNING))
    sock.bind(("127.0.0.1", 53))
    pid = os.fork()
    if pid:  # listening: the caller goes on; its $(...) ends when the child lets go of stdout
        print(pid, flush=True)
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        query, peer = sock.recvfrom(512)
        sock.sendto(answer(query, table), peer)


if __name__ == "__main__":
    main()

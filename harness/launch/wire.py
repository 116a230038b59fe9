"""A rank's messages to the parent, with their arrays out of band.

A case's trajectory is tens of megabytes of float64 arrays (92 MB for a 5-step, 2-rank NVMe case of a
1 MiB-per-rank matrix). ``Connection.send`` pickles it in band: each array is copied into the pickle,
the parent reads the socket in chunks into a growing buffer, and loading copies each array out once
more. Pickle protocol 5 hands every contiguous array's memory to ``buffer_callback`` instead: the rank
writes it to the socket straight from the array, and the parent reads it straight into the buffer the
rebuilt array then owns (writable, as an array unpickled in band is).

The frame: the length of a pickle (8 bytes), that pickle (the sizes of the out-of-band buffers and
the pickle of the message that refers to them), then those buffers, back to back. ``wire`` reads and
writes the whole frame itself, so a sender gone anywhere in it is an ``EOFError`` (``Connection.recv``
raises ``OSError`` for a message cut short). Only the ranks' direction of the pipe carries frames.
"""
from __future__ import annotations

import os
import pickle
import struct
from multiprocessing.connection import Connection

_LENGTH = struct.Struct("!Q")


def send(conn: Connection, obj) -> None:
    buffers: list[pickle.PickleBuffer] = []
    message = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    views = [b.raw() for b in buffers]  # contiguous by construction: pickle passes only those out of band
    head = pickle.dumps(([v.nbytes for v in views], message), protocol=5)
    fd = conn.fileno()
    for view in [memoryview(_LENGTH.pack(len(head)) + head), *views]:
        while view.nbytes:
            view = view[os.write(fd, view):]


def recv(conn: Connection):
    fd = conn.fileno()
    (n,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
    sizes, message = pickle.loads(_read_exactly(fd, n))
    return pickle.loads(message, buffers=[_read_exactly(fd, k) for k in sizes])


def _read_exactly(fd: int, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.readv(fd, [view[got:]])
        if k == 0:
            raise EOFError(f"the sender closed its end {got} of {n} bytes into a part of its frame")
        got += k
    return buf

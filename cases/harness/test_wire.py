"""A rank's message arrives as it was sent: every array bit for bit, with its dtype, shape and the memory
order in-band pickling gives, writable; a sender that dies mid-frame is an ``EOFError``, as with ``Connection.recv``."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading

import numpy as np
import pytest

from harness.case.trajectory import ParamStep, StepRecord, Trajectory
from harness.launch import wire


def _message() -> tuple:
    rng = np.random.default_rng(7)
    big = rng.standard_normal((8, 65536))
    big[0, :3] = [np.nan, -0.0, np.inf]
    step = StepRecord(step=1, loss_scale=2.0 ** 16, loss_scale_after=2.0 ** 15, skipped=False, global_norm=None,
                      muon_calls=2, params={"w": ParamStep(master=big.astype(np.float32), model=big, grad=big.T,
                                                           momentum=big[:, ::2], update=np.empty((0, 4)))})
    traj = Trajectory(case_name="wire", initial={"w": np.asfortranarray(big[:, :100])}, steps=[step])
    return "done", traj, np.arange(5, dtype=np.int16), 0.25


def _same(a, b) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        in_band = pickle.loads(pickle.dumps(a))  # what ``Connection.send`` gives (a strided array: C order)
        assert (b.flags.c_contiguous, b.flags.f_contiguous) == (in_band.flags.c_contiguous, in_band.flags.f_contiguous)
        assert a.tobytes() == b.tobytes() and b.flags.writeable
    elif hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b)
        for f in a.__dataclass_fields__:
            _same(getattr(a, f), getattr(b, f))
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    else:
        assert a == b


def test_a_message_with_arrays_arrives_bit_for_bit_and_writable():
    here, there = mp.Pipe()
    sent = _message()
    # the frame is larger than a socket buffer: the sender blocks until the receiver reads
    sender = threading.Thread(target=wire.send, args=(there, sent))
    sender.start()
    got = wire.recv(here)
    sender.join(timeout=60)
    _same(sent, got)
    got[1].steps[0].params["w"].model[0, 0] = 1.0  # a judge may write into what it received


def _frame(obj) -> bytes:
    """Every byte ``send`` writes for ``obj``."""
    here, there = mp.Pipe()
    out = bytearray()

    def send_and_close():
        wire.send(there, obj)
        there.close()

    sender = threading.Thread(target=send_and_close)
    sender.start()
    while chunk := os.read(here.fileno(), 1 << 20):
        out.extend(chunk)
    sender.join(timeout=60)
    return bytes(out)


def _write_then_close(conn, data: bytes) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(conn.fileno(), view):]
    conn.close()


@pytest.mark.parametrize("cut", [4, 100, 0.5, 0.999])  # in the length, the head, the first buffer, the last
def test_a_sender_gone_mid_frame_is_an_eof(cut):
    frame = _frame(_message())
    here, there = mp.Pipe()
    end = cut if isinstance(cut, int) else int(len(frame) * cut)
    writer = threading.Thread(target=_write_then_close, args=(there, frame[:end]))
    writer.start()
    with pytest.raises(EOFError):
        wire.recv(here)
    writer.join(timeout=60)

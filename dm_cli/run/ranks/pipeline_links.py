"""How the ranks of `--parallel pipeline` talk (dm_cli.run.ranks.pipeline): tensors to and from the neighbouring ranks
(`Links`), the threads of the prompts in flight and how a stopping rank waits for them (`RankThread`, `join_all`),
and whose turn it is (`Turns`). Apart from the slice and the loop so each stays one room."""

from __future__ import annotations

import queue
import re
import threading
import time

from dm_cli.errors import EXIT_INTERNAL, DmapError


class RankLostError(DmapError):
    """Another rank of the pipeline stopped (killed, out of memory, its machine gone)."""

    exit_code = EXIT_INTERNAL



# --- messages between the ranks --------------------------------------------------------------------------

_HEADER = 11  # dtype code, complex flag, ndim, up to 8 dimensions


def _dtypes():
    import torch  # lazy: torch (heavy, off start-up)

    return (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
            torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)


class Links:
    """Tensors sent to and received from the neighbouring ranks, in order: each message is a count, a header per
    tensor (dtype, shape) and the tensors themselves (on the rank's device: NCCL between GPUs, gloo on CPUs)."""

    def __init__(self, device):
        self.device = device
        self.pending: list = []  # (work, tensor): sends in flight on GPUs, with what they read
        # gloo's sends report completion only to wait(): on CPUs a thread waits for each in turn and lets its tensors
        # go (kept until the end of the chunk, the first rank of the bench held every activation it sent, +180 MB)
        self._sent: queue.Queue | None = None
        self._error: BaseException | None = None
        self._reaper: RankThread | None = None
        if device.type == "cpu":
            self._sent = queue.Queue()
            self._reaper = RankThread(self._reap, (self._sent,), "dmap-pipeline-sends")
            self._reaper.start()

    def _reap(self, sent: queue.Queue) -> None:
        while True:
            item = sent.get()
            if item is None:  # close()
                sent.task_done()
                return
            work, _tensor = item
            try:
                work.wait()
            except RuntimeError as error:
                self._error = self._error or error
            finally:
                del work, _tensor, item
                sent.task_done()

    def send(self, tensors: list, dst: int) -> None:
        import torch  # lazy: torch (heavy, off start-up)

        codes = _dtypes()
        header = torch.zeros(1 + _HEADER * len(tensors), dtype=torch.int64)
        header[0] = len(tensors)
        payloads = []
        for i, tensor in enumerate(tensors):
            tensor = tensor.detach()
            flag = int(tensor.is_complex())
            if flag:
                tensor = torch.view_as_real(tensor)
            if tensor.dim() > 8 or tensor.dtype not in codes:
                raise RuntimeError(f"dmap's pipeline cannot send a {tensor.dtype} tensor of {tensor.dim()} dimensions.")
            row = [codes.index(tensor.dtype), flag, tensor.dim(), *tensor.shape]
            header[1 + i * _HEADER:1 + i * _HEADER + len(row)] = torch.tensor(row, dtype=torch.int64)
            payloads.append(tensor.contiguous())
        self._send(torch.tensor([len(tensors)], dtype=torch.int64), dst)
        self._send(header, dst)
        for payload in payloads:
            self._send(payload, dst)

    def recv(self, src: int) -> list:
        import torch  # lazy: torch (heavy, off start-up)

        codes = _dtypes()
        count = torch.empty(1, dtype=torch.int64)
        self._recv(count, src)
        header = torch.empty(1 + _HEADER * int(count[0]), dtype=torch.int64)
        self._recv(header, src)
        out = []
        for i in range(int(count[0])):
            row = header[1 + i * _HEADER:1 + (i + 1) * _HEADER].tolist()
            code, flag, ndim = row[0], row[1], row[2]
            tensor = torch.empty(row[3:3 + ndim], dtype=codes[code], device=self.device)
            self._recv(tensor, src)
            out.append(torch.view_as_complex(tensor) if flag else tensor)
        return out

    def _send(self, tensor, dst: int) -> None:
        import torch.distributed as dist  # lazy: torch (heavy, off start-up)

        if self._error is not None:
            raise _lost(dst, self._error)
        try:  # headers travel over gloo, payloads on GPUs over NCCL: torch routes each by its device
            work = dist.isend(tensor, dst)
        except RuntimeError as error:
            raise _lost(dst, error) from None
        if self._sent is not None:
            self._sent.put((work, tensor))
            return
        self.pending.append((work, tensor))
        self.pending = [(work, t) for work, t in self.pending if not work.is_completed()]

    def _recv(self, tensor, src: int) -> None:
        import torch.distributed as dist  # lazy: torch (heavy, off start-up)

        try:
            dist.recv(tensor, src)
        except RuntimeError as error:
            raise _lost(src, error) from None

    def flush(self) -> None:
        """Wait for every send in flight (before the tensors they read may go)."""
        if self._sent is not None:
            self._sent.join()
        pending, self.pending = self.pending, []
        for work, _ in pending:
            try:
                work.wait()
            except RuntimeError as error:
                raise _lost(None, error) from None
        if self._error is not None:
            error, self._error = self._error, None
            raise _lost(None, error)

    def close(self) -> None:
        """Stop the thread that waits for the CPU sends (after `flush`), and wait until it has: a thread still in
        gloo's wait when the interpreter exits is killed inside C++ code, and the process aborts."""
        if self._sent is not None:
            self._sent.put(None)
            self._sent = None
        if self._reaper is not None:
            join_all([self._reaper])
            self._reaper = None


# Joining the threads of a stopping rank waits at most this long. A thread holding the turn finishes its slice of one
# denoiser call (a receive included: the peers keep their turns until they stop or are lost, and a lost peer's socket
# fails the receive), then stops; the bound is only against a peer that hangs without dying.
STOP_WAIT_S = 120.0


class RankThread(threading.Thread):
    """A daemon thread of a pipeline rank that says when its target has returned (`finished`). Its end is waited for
    on that event, never on `Thread.join`/`is_alive`: in Python 3.9.8 to 3.11, a `join(timeout)` interrupted by a
    signal handler's exception (Ctrl-C, SIGTERM: always the main thread, and it is always joining here) marks the
    thread it joins stopped although it still runs (bpo-45274's fix releases the thread's own lock); the rank then
    leaves and kills it inside torch's C++ code (`terminate called without an active exception`, SIGABRT)."""

    def __init__(self, target, args: tuple, name: str):
        super().__init__(name=name, daemon=True)
        self.finished = threading.Event()
        self._work = (target, args)

    def run(self) -> None:
        target, args = self._work
        try:
            target(*args)
        finally:
            self.finished.set()


def join_all(threads, timeout_s: float = STOP_WAIT_S) -> bool:
    """Wait for `threads` (RankThreads) to end, a second Ctrl-C or SIGTERM included (the first already stopped them;
    leaving now would kill them inside torch's C++ code at the interpreter's exit: `terminate called without an
    active exception`, SIGABRT). Returns whether they all ended within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        while not thread.finished.is_set() and time.monotonic() < deadline:
            try:
                thread.finished.wait(0.2)
            except BaseException:  # noqa: BLE001 - already stopping: a repeated signal waits for the same end
                continue
    return all(thread.finished.is_set() for thread in threads)


def _lost(peer: int | None, error: Exception) -> RankLostError:
    who = f"rank {peer}" if peer is not None else "another rank"
    # gloo's text starts with its source line ("[/path/pair.cc:553] Connection closed by peer [addr]:port. This is...")
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h)[^\]]*\]\s*", "", str(error).strip())
    reason = re.split(r"(?<=[^\s\]])\.\s", text.splitlines()[0] if text else "")[0][:160] or type(error).__name__
    return RankLostError(f"The pipeline lost {who} ({reason}): the run stops here; what was written is complete, and "
                         "the same command resumes the rest.")


# --- whose turn it is -----------------------------------------------------------------------------------


class _Stopped(Exception):
    """Another prompt in flight on this rank failed: this one stops too."""


class Turns:
    """Which prompt in flight computes now on this rank: a fixed round robin, the same on every rank."""

    def __init__(self, slots: int):
        self._cond = threading.Condition()
        self._order = list(range(slots))
        self._current = 0 if slots else None
        self.error: BaseException | None = None

    def wait(self, slot: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.error is not None or self._current == slot)
            if self.error is not None:
                raise _Stopped()

    def pass_on(self, slot: int) -> None:
        with self._cond:
            position = self._order.index(slot)
            self._current = self._order[(position + 1) % len(self._order)]
            self._cond.notify_all()

    def leave(self, slot: int) -> None:
        with self._cond:
            position = self._order.index(slot)
            self._order.pop(position)
            self._current = self._order[position % len(self._order)] if self._order else None
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

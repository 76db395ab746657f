"""Activation offload (`train.offload_buffer_gb`): what full recomputation keeps for the backward, each decoder
layer's input, goes to host memory in the forward and comes back for the layer's recomputation in the backward.

- The layer runs under full recomputation's checkpoint (non-reentrant: the forward builds the layer's graph as
  without recomputation, the saved tensors are made again in the backward), but the checkpoint is not handed the
  layer's inputs: the layer reads them from a box that holds the device tensors during the forward and, after it,
  their `HostOffload` copies; the recomputation reads them back from there. A tensor several layers read (the
  completed AttnRes blocks every later layer mixes) is copied once and shared.
- Bounded: the host copies of one rank live in host buffers of at most `budget` bytes in all, allocated as a run
  first needs them, each of exactly a tensor's size, and reused (a released buffer takes the next tensor of its size:
  the layer inputs of one run are all alike), so the host memory is the most a step holds at once, the planner's
  figure; what does not fit stays on the device (counted in `kept_on_device`). An idle buffer dropped to make room
  for another size is first waited for (on CUDA its last copy may still be reading it). On CUDA the buffers are
  pinned by registering them with the driver (cudaHostRegister), not through torch's pinned allocator, which rounds
  every allocation up to a power of two (up to twice the budget) and caches it.
- Overlapped on CUDA: the device-to-host copy runs on a side stream after the current stream's work that made the
  tensor (the device memory is released when the copy is done, `record_stream`); in the backward, reading a layer's
  inputs back also starts loading the inputs of the layer packed before it (the one whose backward comes next), on
  another side stream, so that load runs while this layer recomputes and back-propagates. A tensor loaded back
  stays on the device until its last reader has read it: in one micro-batch's backward the device holds the
  completed blocks the layer reads, its running partial sum and the next layer's (what the planner counts,
  planning.memory). The streams and events are CudaCopies' (the only CUDA calls besides pinning); HostOffload hands
  each copy the events it must follow. On the CPU the same code runs with synchronous copies (made under
  `host_context`, so a memory measurement can count them as host memory); tests/test_tiling.py runs the asynchronous
  path on the CPU with copies deferred as long as the events allow, and CudaCopies' own code under a model of CUDA's
  streams, events and caching allocator (each of its waits and its record_stream taken out in turn is seen).

Exact: the host round trip copies the values and the graph is full recomputation's: bit-identical gradients
(tests/test_tiling.py).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

__all__ = ["CudaCopies", "HostOffload"]

_PAGE = 4096  # host page size: what cudaHostRegister pins in


def _buffer_size(nbytes: int, pinned: bool) -> int:
    return -(-nbytes // _PAGE) * _PAGE if pinned else nbytes


def _unregister(data: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(data.data_ptr())


class _Held:
    """One offloaded tensor: its host copy (a view of its _Buffer; the device tensor itself when the budget is spent),
    the device and the copy's completion event (asynchronous copies only)."""

    def __init__(self, host, device, nbytes: int, event=None, on_device: bool = False, buffer=None):
        self.host, self.device, self.nbytes, self.event, self.on_device = host, device, nbytes, event, on_device
        self.buffer = buffer
        self.back = None  # the device copy, once loaded (prefetched or on demand)
        self.back_event = None
        self.users = 0


class CudaCopies:
    """The asynchronous copies, on CUDA: device to host on one side stream, host to device on another, ordered by
    events. HostOffload asks only these five things of a device's copies (tests/test_tiling.py runs it with copies
    that defer every copy as long as the events allow, so a missing wait reads a value not yet copied)."""

    pinned = True  # the host buffers are registered with the driver (page-locked), so the copies can be asynchronous

    def __init__(self):
        self._streams = None

    @staticmethod
    def serves(device: torch.device) -> bool:
        return device.type == "cuda"

    def _side_streams(self, device: torch.device):
        if self._streams is None:  # one device per process (launch.py sets it before the first forward)
            self._streams = (torch.cuda.Stream(device=device), torch.cuda.Stream(device=device))
        return self._streams

    def down(self, t: torch.Tensor, host: torch.Tensor, after):
        """Copy `t` into `host` after the current stream's work so far (which made `t`) and after the event `after`
        (the last copy that read `host`'s buffer; None: none); `t`'s device memory stays allocated until the copy
        has read it. Returns the copy's event."""
        down, _ = self._side_streams(t.device)
        down.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(down), torch.no_grad():  # a copy of values: autograd records none of it
            if after is not None:
                down.wait_event(after)
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(down)
        t.record_stream(down)
        return event

    def up(self, host: torch.Tensor, device: torch.device, after):
        """A device copy of `host`, made after the event `after` (the copy into `host`): (the tensor, its event)."""
        _, up = self._side_streams(device)
        with torch.cuda.stream(up), torch.no_grad():
            up.wait_event(after)
            back = host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(up)
        return back, event

    @staticmethod
    def use(t: torch.Tensor, event) -> None:
        """The current stream reads `t` (made by `up`) after its event; its memory is not reused before."""
        stream = torch.cuda.current_stream(t.device)
        stream.wait_event(event)
        t.record_stream(stream)

    @staticmethod
    def wait(event) -> None:
        """The host waits for the event (before it frees memory a copy may still read)."""
        event.synchronize()


class _Buffer:
    """`nbytes` of host memory, pinned by registration when `pinned` (page-aligned and whole pages, so no two
    registered ranges share a page); `ready`: the CUDA event after which its last copy back to the device has read
    it (the next copy into it waits for it); `size`: the bytes it takes."""

    def __init__(self, nbytes: int, pinned: bool):
        self.ready = None
        self.size = _buffer_size(nbytes, pinned)
        if not pinned:
            self.data = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
            return
        raw = torch.empty(self.size + _PAGE, dtype=torch.uint8, device="cpu")  # host memory, whatever the default
        start = -raw.data_ptr() % _PAGE
        region = raw[start:start + self.size]
        err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), self.size, 0)
        if int(err) != 0:
            raise RuntimeError(f"train.offload_buffer_gb: pinning {self.size} bytes of host memory failed "
                               f"(cudaHostRegister: {err}); lower train.offload_buffer_gb")
        weakref.finalize(self, _unregister, region)  # holds the memory until it is unregistered
        self.data = region[:nbytes]

    def view(self, shape, dtype) -> torch.Tensor:
        return self.data.view(dtype).view(shape)


class HostOffload:
    def __init__(self, budget_bytes: int, copies=None):
        self.budget = int(budget_bytes)
        self.copies = CudaCopies() if copies is None else copies  # the asynchronous copies, for the devices they serve
        self.used = 0
        self.peak = 0
        self.kept_on_device = 0  # bytes the budget could not take
        self.allocated = 0  # bytes of host buffers, in use or free for reuse (at most the budget)
        self._free = {}  # nbytes -> the _Buffers of that size no tensor uses now
        self.reloaded = self.reload_peak = 0  # bytes loaded back onto the device and not yet read for the last time
        self._by_storage = {}  # (storage pointer, offset, shape) -> _Held, while saved
        self._layers = []  # per layer packed, in order, the _Held of each input: the backward reads them in reverse
        self._started = set()  # the layers whose inputs the backward has begun to read
        self.host_context = contextlib.nullcontext  # what the host copies are made under (a memory measurement's tag)

    def pack_layer(self, tensors) -> list:
        """One layer's inputs, after its forward: their host copies (each tensor once, however many layers read it),
        as the handles `unpack` takes."""
        layer = len(self._layers)
        helds = [self._pack(t) for t in tensors]
        self._layers.append(helds)
        return [(key, held, layer) for key, held in helds]

    def _pack(self, t: torch.Tensor):
        # the same tensor saved by several layers is held once; a key is trusted only while the tensor it was made
        # for is alive (after that its memory may hold another tensor)
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        held = self._by_storage.get(key)
        if held is None or held.src() is not t:
            held = self._offload(t)
            held.src = weakref.ref(t)
            self._by_storage[key] = held
        held.users += 1
        return key, held

    def reset(self) -> None:
        """Forget what a step left unread (a forward without its backward; their host buffers are reused): the
        trainer calls it at each step's start, when every backward of the step before has run."""
        for layer in self._layers:
            for _, held in layer:
                self._give_back(held, held.event if held.back_event is None else held.back_event)
                held.host = held.back = None  # a handle kept past the reset reads nothing its buffer holds next
        self._by_storage.clear()
        self._layers.clear()
        self._started.clear()
        self.used = self.reloaded = 0

    def release_idle(self) -> None:
        """Free every host buffer no tensor uses now (after `reset`, or a step's last backward: all of them), each
        after its last copy; the next offloads allocate theirs anew (a memory measurement of one step sees them)."""
        for bufs in self._free.values():
            while bufs:
                self._drop(bufs.pop())

    def _take(self, nbytes: int, pinned: bool):
        """A host buffer of `nbytes`: a free one of that size, else a new one if the budget has room (made by
        dropping free buffers of other sizes if need be), else None."""
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        need = _buffer_size(nbytes, pinned)
        idle = sum(b.size for bufs in self._free.values() for b in bufs)
        if self.allocated - idle + need > self.budget:  # no room even without the idle buffers: keep them
            return None
        for bufs in self._free.values():
            while bufs and self.allocated + need > self.budget:
                self._drop(bufs.pop())
        with self.host_context():
            buf = _Buffer(nbytes, pinned)
        self.allocated += buf.size
        return buf

    def _drop(self, buf: _Buffer) -> None:
        """Free an idle buffer. On CUDA its last copy back to the device may still be reading it: wait for that copy
        first (unregistering and freeing the host memory under an in-flight copy would hand it garbage)."""
        if buf.ready is not None:
            self.copies.wait(buf.ready)
        self.allocated -= buf.size

    def _give_back(self, held: _Held, ready) -> None:
        if held.buffer is not None:
            held.buffer.ready = ready
            self._free.setdefault(held.nbytes, []).append(held.buffer)
            held.buffer = None

    def _offload(self, t: torch.Tensor) -> _Held:
        nbytes = t.numel() * t.element_size()
        asynchronous = self.copies.serves(t.device)
        buf = self._take(nbytes, pinned=asynchronous and self.copies.pinned)
        if buf is None:
            self.kept_on_device += nbytes
            return _Held(t, t.device, nbytes, on_device=True)
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        host = buf.view(t.shape, t.dtype)
        if not asynchronous:  # the same path, synchronous: a host copy the device tensor no longer backs
            host.copy_(t)
            return _Held(host, t.device, nbytes, buffer=buf)
        # a reused buffer is written after its last copy back to the device has read it
        return _Held(host, t.device, nbytes, self.copies.down(t, host, buf.ready), buffer=buf)

    def _load(self, held: _Held) -> None:
        if held.back is not None or held.on_device or held.host is None:  # loaded, never moved, or read and released
            return
        self.reloaded += held.nbytes
        self.reload_peak = max(self.reload_peak, self.reloaded)
        if held.event is None:  # a device copy, as the asynchronous path makes (the host copy is released after its
            held.back = held.host.to(held.device, copy=True)  # last read)
            return
        held.back, held.back_event = self.copies.up(held.host, held.device, held.event)

    def unpack(self, packed) -> torch.Tensor:
        key, held, layer = packed
        if held.host is None and held.back is None:
            raise RuntimeError("parallel.offload: a layer input read after its last reader or after "
                               "HostOffload.reset() (a backward run twice, or a step's backward after the next began)")
        if layer not in self._started:  # the first read of a layer's inputs starts loading all of them, then those
            self._started.add(layer)  # of the layer packed before (whose backward comes next): a prefetch, also
            for group in self._layers[max(layer - 1, 0):layer + 1][::-1]:  # where this layer's stayed on the device
                for _, h in group:
                    self._load(h)
        if held.on_device:
            out = held.host
        else:
            self._load(held)
            out = held.back
            if held.back_event is not None:
                self.copies.use(out, held.back_event)
        held.users -= 1
        if held.users <= 0:
            self._release(key, held)
        return out

    def _release(self, key, held: _Held) -> None:
        if self._by_storage.get(key) is held:
            del self._by_storage[key]
        if not held.on_device:
            self.used -= held.nbytes
        if held.back is not None:
            self.reloaded -= held.nbytes
        self._give_back(held, held.back_event)  # the copy back has read it (CUDA: when its event has passed)
        held.host = held.back = None



"""protocol.pinned_memory with a stand-in for CUDA's runtime binding (the GPU tier pins for real:
tests/gpu/test_slots_gpu.py): whole pages registered, a stale registration at a new mapping's
addresses replaced, a refusal returned as its code."""

from __future__ import annotations

import mmap

from protocol import pinned_memory


class Runtime:
    """Answers cudaHostRegister with the codes given, in order; records every call."""

    def __init__(self, *register_codes: int, unregister_code: int = 0):
        self.codes = list(register_codes)
        self.unregister_code = unregister_code
        self.calls: list[tuple] = []

    def cudaHostRegister(self, address, length, flags):  # noqa: N802 (CUDA's name)
        self.calls.append(("register", address, length, flags))
        return self.codes.pop(0)

    def cudaHostUnregister(self, address):  # noqa: N802
        self.calls.append(("unregister", address))
        return self.unregister_code


def test_the_whole_mapping_is_registered_in_whole_pages():
    runtime = Runtime(0)
    assert pinned_memory.register(runtime, 4096 * 7, 918_784) == 0
    pages = -(-918_784 // mmap.PAGESIZE)
    assert runtime.calls == [("register", 4096 * 7, pages * mmap.PAGESIZE, 0)]
    assert pinned_memory.whole_pages(mmap.PAGESIZE) == mmap.PAGESIZE


def test_a_stale_registration_at_a_new_mappings_address_is_replaced():
    runtime = Runtime(pinned_memory.ALREADY_REGISTERED, 0)
    assert pinned_memory.register(runtime, 8192, 100, pinned_memory.READ_ONLY) == 0
    assert [c[0] for c in runtime.calls] == ["register", "unregister", "register"]


def test_a_refusal_is_returned_and_nothing_is_retried():
    runtime = Runtime(1)
    assert pinned_memory.register(runtime, 8192, 100) == 1
    assert len(runtime.calls) == 1
    assert pinned_memory.error_text(1).startswith("error 1")


def test_a_stale_registration_that_cannot_be_dropped_leaves_the_mapping_unpinned():
    runtime = Runtime(pinned_memory.ALREADY_REGISTERED, unregister_code=1)
    assert pinned_memory.register(runtime, 8192, 100) == pinned_memory.ALREADY_REGISTERED


class Mapping:
    """Stands for an mmap: what matters is when it may go."""


def test_a_pin_keeps_its_mapping_until_it_is_released_once():
    import weakref

    runtime, mapping = Runtime(0), Mapping()
    gone = weakref.ref(mapping)
    pin = pinned_memory.Pin(runtime, mapping, 8192, 100)
    del mapping
    assert pin.pinned and gone() is not None  # never unmapped while registered
    pin.release()
    pin.release()
    assert not pin.pinned and gone() is None
    assert [c[0] for c in runtime.calls] == ["register", "unregister"]


def test_a_dropped_pin_is_unregistered_and_a_refused_one_holds_nothing():
    runtime = Runtime(0, 1)
    pin = pinned_memory.Pin(runtime, Mapping(), 8192, 100)
    del pin
    assert [c[0] for c in runtime.calls] == ["register", "unregister"]
    refused = pinned_memory.Pin(runtime, Mapping(), 8192, 100)
    assert (refused.pinned, refused.code) == (False, 1)
    del refused
    assert [c[0] for c in runtime.calls] == ["register", "unregister", "register"]

"""engine/driver_init.py: which device the background driver initialisation targets, the driver calls
it makes (against a stand-in for libcuda that records them), and that failures end it quietly."""

from __future__ import annotations

import pytest

from tinyvllm.engine import driver_init
from tinyvllm.engine.driver_init import DriverInit


@pytest.mark.parametrize(
    ("device", "ordinal"),
    [("auto", 0), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), ("cpu", None), ("cuda:x", None), ("meta", None)],
)
def test_ordinal_follows_the_device_argument(device, ordinal):
    assert driver_init._driver_ordinal(device) == ordinal


class _FakeDriver:
    """Records the driver API calls; `fail` names the call that returns an error (CUDA_ERROR_* != 0)."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail = fail

    def _result(self, name: str) -> int:
        return 100 if name == self.fail else 0

    def cuInit(self, flags):
        self.calls.append(("cuInit", flags))
        return self._result("cuInit")

    def cuDeviceGet(self, dev_ref, ordinal):
        self.calls.append(("cuDeviceGet", ordinal))
        dev_ref._obj.value = 40 + ordinal  # the handle the driver hands back
        return self._result("cuDeviceGet")

    def cuDevicePrimaryCtxRetain(self, ctx_ref, dev):
        self.calls.append(("cuDevicePrimaryCtxRetain", dev.value))
        return self._result("cuDevicePrimaryCtxRetain")


def _with_driver(monkeypatch, fake):
    def cdll(name):
        assert name == "libcuda.so.1"
        if fake is None:
            raise OSError("libcuda.so.1: cannot open shared object file")
        return fake

    monkeypatch.setattr(driver_init.ctypes, "CDLL", cdll)


def test_initialises_the_driver_then_retains_the_devices_primary_context(monkeypatch):
    fake = _FakeDriver()
    _with_driver(monkeypatch, fake)
    init = DriverInit("cuda:2")
    init.join()
    assert init.loaded and init.ready
    assert fake.calls == [("cuInit", 0), ("cuDeviceGet", 2), ("cuDevicePrimaryCtxRetain", 42)]


@pytest.mark.parametrize("fail", ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"])
def test_a_failing_driver_call_ends_it_without_an_error(monkeypatch, fail):
    fake = _FakeDriver(fail=fail)
    _with_driver(monkeypatch, fake)
    init = DriverInit("auto")
    init.join()
    assert init.loaded and not init.ready
    assert fake.calls[-1][0] == fail  # nothing after the failing call


def test_no_driver_library_or_a_cpu_device_starts_nothing(monkeypatch):
    _with_driver(monkeypatch, None)
    init = DriverInit("auto")
    init.join()
    assert not init.loaded and not init.ready
    _with_driver(monkeypatch, _FakeDriver())
    cpu = DriverInit("cpu")
    cpu.join()
    assert not cpu.loaded and cpu._thread is None

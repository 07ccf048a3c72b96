"""The loader's error text for a weight-ring timeout (vm/loader.py MegakernelVM._describe), hand-checked without a
GPU: a compute warp's wait names the slot whose bulk copy never landed (detail -1 - slot); the producer warp's
wait (detail -1 - stages - slot) names the slot the compute warps never released."""
import types

from vm import abi
from vm.loader import MegakernelVM


def _vm(ring_bytes: int, stage_bytes: int) -> MegakernelVM:
    vm = object.__new__(MegakernelVM)   # (no build, no GPU: only what _describe reads)
    task = types.SimpleNamespace(id=7, label="L0.o_proj[0:16]")
    vm.program = types.SimpleNamespace(tasks=[task])
    vm.timeout_s = 2.0
    vm.ring_bytes = ring_bytes
    vm.build_info = {"stage_bytes": stage_bytes}
    return vm


def test_ring_timeouts_name_slot_and_side():
    vm = _vm(9 * 16384, 16384)
    gemv = abi.OPCODES["GEMV"].code
    consumer = vm._describe(abi.STATUS_TIMEOUT, 7, gemv, -1 - 4, 3)
    assert "waited for weight-ring slot 4" in consumer and "task 7 (GEMV, L0.o_proj[0:16]) on SM 3" in consumer
    assert "never issued by the producer" in consumer   # (a consumer first waits for its stage to be issued)
    producer = vm._describe(abi.STATUS_TIMEOUT, 7, gemv, -1 - 9 - 2, 3)
    assert "producer" in producer and "slot 2 to be released" in producer
    # a build without the ring never reads a producer detail as one
    assert "weight-ring slot 11" in _vm(0, 16384)._describe(abi.STATUS_TIMEOUT, 7, gemv, -1 - 11, 3)

"""What every rank that harness/hvdrun.py starts for the tests does first (tests/conftest.py
names it in HVD_DGC_RANK_SETUP): with HVD_DGC_TEST_DEVICE other than cpu, prepare the
process for the device before Horovod's first collective (tests/device.py)."""

import os


def prepare():
    if os.environ.get("HVD_DGC_TEST_DEVICE", "cpu") != "cpu":
        from tests.device import prepare_process
        prepare_process()

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ranks started by harness/hvdrun.py (it hands them this environment) run this first.
os.environ.setdefault("HVD_DGC_RANK_SETUP", "tests.rank_setup:prepare")
# The suite asserts paths, bytes and values: every test wraps with the assumed link
# (CostModel(), the same paths on every run) unless it names its own cost model; the
# default, the link measured, is tested where it is set (tests/core/test_linkprobe.py passes
# HVD_DGC_COST_MODEL="" to its ranks).
os.environ.setdefault("HVD_DGC_COST_MODEL", "assumed")

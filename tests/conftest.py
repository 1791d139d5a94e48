import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ranks started by harness/hvdrun.py (it hands them this environment) run this first.
os.environ.setdefault("HVD_DGC_RANK_SETUP", "tests.rank_setup:prepare")

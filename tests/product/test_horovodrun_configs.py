"""Every file in horovodrun_configs/ goes through Horovod's own --config-file parser."""

import glob
import os
import sys

import pytest

from harness.hvdrun import REPO

CONFIGS = sorted(glob.glob(os.path.join(REPO, "horovodrun_configs", "*.yaml")))


def horovod_env_for(path, monkeypatch):
    from horovod.runner import launch
    from horovod.runner.common.util import config_parser
    monkeypatch.setattr(sys, "argv", ["horovodrun", "-np", "2", "--config-file", path,
                                      "python", "train.py"])
    args = launch.parse_args()
    config_parser.validate_config_args(args)
    env = {}
    config_parser.set_env_from_args(env, args)
    return env


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_parses_with_horovod(path, monkeypatch):
    env = horovod_env_for(path, monkeypatch)
    assert int(env["HOROVOD_FUSION_THRESHOLD"]) > 0
    assert float(env["HOROVOD_CYCLE_TIME"]) > 0


def test_cheap_1gbe_values(monkeypatch):
    env = horovod_env_for(os.path.join(REPO, "horovodrun_configs", "cheap_1gbe.yaml"), monkeypatch)
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(64 * 1024 * 1024)
    assert float(env["HOROVOD_CYCLE_TIME"]) == 5.0
    assert env["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "300"
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "120"
    assert env["HOROVOD_LOG_LEVEL"] == "warning"  # Horovod lower-cases it when parsing


def test_datacenter_and_wan_values(monkeypatch):
    dc = horovod_env_for(os.path.join(REPO, "horovodrun_configs", "datacenter_25gbe.yaml"),
                         monkeypatch)
    assert dc["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "1" and dc["HOROVOD_AUTOTUNE"] == "1"
    assert float(dc["HOROVOD_CYCLE_TIME"]) == 1.0
    wan = horovod_env_for(os.path.join(REPO, "horovodrun_configs", "wan_cross_region.yaml"),
                          monkeypatch)
    assert wan["HOROVOD_FUSION_THRESHOLD"] == str(128 * 1024 * 1024)
    assert float(wan["HOROVOD_CYCLE_TIME"]) == 20.0
    assert wan["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "900"
    assert "HOROVOD_AUTOTUNE" not in wan and wan["HOROVOD_HIERARCHICAL_ALLREDUCE"] == "0"

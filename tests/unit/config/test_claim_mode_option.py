"""``execution.state-recovery.claim-mode``: Flink's values, its legacy key, and LEGACY refused."""

from __future__ import annotations

import logging

import pytest

from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.config import Configuration
from keyedstate.common.config import options as o
from keyedstate.common.errors import ConfigError, InvalidArgumentError

CONFIG_LOGGER = "keyedstate.common.config._configuration"


def test_default_is_no_claim_as_in_flink() -> None:
    assert Configuration().get(o.CLAIM_MODE) is RecoveryClaimMode.NO_CLAIM


@pytest.mark.parametrize(
    "raw,mode",
    [
        ("CLAIM", RecoveryClaimMode.CLAIM),
        ("claim", RecoveryClaimMode.CLAIM),
        (" NO_CLAIM ", RecoveryClaimMode.NO_CLAIM),
    ],
)
def test_values_are_case_insensitive(raw: str, mode: RecoveryClaimMode) -> None:
    assert Configuration({"execution.state-recovery.claim-mode": raw}).get(o.CLAIM_MODE) is mode


def test_legacy_key_is_read_with_a_warning_naming_the_current_key(caplog: pytest.LogCaptureFixture) -> None:
    conf = Configuration({"execution.savepoint-restore-mode": "CLAIM"})
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        assert conf.get(o.CLAIM_MODE) is RecoveryClaimMode.CLAIM
        assert conf.validate() == []  # a known (deprecated) key, not an unknown one
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1
    assert "'execution.savepoint-restore-mode'" in warnings[0]
    assert "'execution.state-recovery.claim-mode'" in warnings[0]


def test_current_key_wins_over_the_legacy_key() -> None:
    conf = Configuration(
        {"execution.savepoint-restore-mode": "CLAIM", "execution.state-recovery.claim-mode": "NO_CLAIM"}
    )
    assert conf.get(o.CLAIM_MODE) is RecoveryClaimMode.NO_CLAIM


@pytest.mark.parametrize("key", ["execution.state-recovery.claim-mode", "execution.savepoint-restore-mode"])
def test_legacy_mode_is_refused_with_the_reason_and_the_modes_to_pick(key: str) -> None:
    with pytest.raises(ConfigError) as err:
        Configuration({key: "LEGACY"}).validate()
    message = err.value.message
    assert message.startswith(f"{key}: ")
    assert "removed in Flink 2.0" in message
    assert "NO_CLAIM" in message and "CLAIM (" in message


def test_an_unknown_mode_names_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        Configuration({"execution.state-recovery.claim-mode": "CLAIMS"}).get(o.CLAIM_MODE)
    assert err.value.message == (
        "execution.state-recovery.claim-mode: 'CLAIMS' is not a claim mode; use CLAIM or NO_CLAIM (the default)"
    )


def test_parse_outside_the_configuration_raises_invalid_argument() -> None:
    # The client and statectl parse --claim-mode before calling the JobManager.
    assert RecoveryClaimMode.parse("no-claim") is RecoveryClaimMode.NO_CLAIM
    with pytest.raises(InvalidArgumentError, match="claim_mode: restore mode LEGACY was removed in Flink 2.0"):
        RecoveryClaimMode.parse("legacy", "claim_mode")

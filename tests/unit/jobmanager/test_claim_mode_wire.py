"""The RestoreJob request's claim_mode as the JobManager reads it."""

from __future__ import annotations

import pytest

from keyedstate.common._proto.v1 import jobmanager_pb2 as jm_pb
from keyedstate.common.claim_mode import RecoveryClaimMode
from keyedstate.common.errors import InvalidArgumentError
from keyedstate.jobmanager.rpc.job_wire import claim_mode_from_proto


def test_every_wire_value_maps_to_a_mode_and_unset_to_the_jobs_own() -> None:
    assert claim_mode_from_proto(jm_pb.RECOVERY_CLAIM_MODE_UNSPECIFIED) is None
    assert claim_mode_from_proto(jm_pb.RECOVERY_CLAIM_MODE_CLAIM) is RecoveryClaimMode.CLAIM
    assert claim_mode_from_proto(jm_pb.RECOVERY_CLAIM_MODE_NO_CLAIM) is RecoveryClaimMode.NO_CLAIM
    assert {v for v in jm_pb.RecoveryClaimMode.values() if v} == {1, 2}, "a new wire value needs a mode"


def test_an_unknown_number_is_an_invalid_argument_naming_the_modes() -> None:
    # proto3 enums are open: a newer client's value arrives as a bare number.
    with pytest.raises(InvalidArgumentError, match="claim_mode 7 is not a RecoveryClaimMode; send CLAIM, NO_CLAIM"):
        claim_mode_from_proto(7)

"""Key groups: how a key finds its subtask, identically in Python and in Spark SQL.

The function (documented in the README and fixed for a job's life)::

    key_group(key) = (XXH64(key_bytes, seed=42) & 0xFFFFFFFF) mod max_parallelism

``key_bytes`` is the key as serialized by the key serializer. XXH64 with seed 42 is exactly
what Spark SQL's ``xxhash64()`` computes, so a DataFrame can be partitioned natively with::

    pmod(xxhash64(key_bytes_col) & 4294967295, max_parallelism)

(see :func:`keyedstate.common.spark.key_group_column`). The low 32 bits make it a 32-bit hash
and ``pmod`` keeps it non-negative.

Subtask assignment follows Flink's ``KeyGroupRangeAssignment``: subtask ``i`` of ``p`` owns
the contiguous range ``[ceil(i*m/p), floor(((i+1)*m - 1)/p)]``, and key group ``g`` belongs to
subtask ``g*p // m``.
"""

from __future__ import annotations

import xxhash

from keyedstate.common.errors import InvalidArgumentError
from keyedstate.common.ids import KeyGroupRange

HASH_SEED = 42
DEFAULT_MAX_PARALLELISM = 128
# Flink's upper bound; also what fits the 2-byte key-group prefix of stored keys.
UPPER_BOUND_MAX_PARALLELISM = 1 << 15

_xxh64 = xxhash.xxh64_intdigest


def key_hash(key: bytes) -> int:
    """The stable 32-bit hash of serialized key bytes (unsigned)."""
    return _xxh64(key, HASH_SEED) & 0xFFFFFFFF


def key_group(key: bytes, max_parallelism: int) -> int:
    """The key group of serialized key bytes."""
    return (_xxh64(key, HASH_SEED) & 0xFFFFFFFF) % max_parallelism


def key_groups(keys: list[bytes], max_parallelism: int) -> list[int]:
    """Key groups of many keys (the hot path of the client and the TaskManager)."""
    h = _xxh64
    m = max_parallelism
    return [(h(k, HASH_SEED) & 0xFFFFFFFF) % m for k in keys]


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    """Raise unless 1 <= parallelism <= max_parallelism <= 32768."""
    if not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise InvalidArgumentError(
            f"max parallelism {max_parallelism} is out of range: use 1..{UPPER_BOUND_MAX_PARALLELISM} "
            "(pipeline.max-parallelism)"
        )
    if not 1 <= parallelism <= max_parallelism:
        raise InvalidArgumentError(
            f"parallelism {parallelism} must be between 1 and the max parallelism {max_parallelism}"
        )


def past_max_parallelism(job_id: str, parallelism: int, max_parallelism: int) -> str:
    """Why a job cannot run at ``parallelism`` above its max parallelism, and what to do instead."""
    return (
        f"job {job_id!r} cannot run at parallelism {parallelism}: its max parallelism is {max_parallelism} (the number "
        f"of key groups, pipeline.max-parallelism), which bounds the parallelism and is fixed for the job's life; more "
        f"TaskManagers would not help. Ask for a parallelism of at most {max_parallelism}; going higher takes a new job "
        "with a larger pipeline.max-parallelism, which starts from empty state (checkpoints cannot change it). The job "
        "keeps running at its current parallelism"
    )


def key_group_range_for_subtask(max_parallelism: int, parallelism: int, subtask_index: int) -> KeyGroupRange:
    """The contiguous key-group range subtask ``subtask_index`` of ``parallelism`` owns."""
    check_parallelism(parallelism, max_parallelism)
    if not 0 <= subtask_index < parallelism:
        raise InvalidArgumentError(f"subtask index {subtask_index} is outside 0..{parallelism - 1}")
    start = (subtask_index * max_parallelism + parallelism - 1) // parallelism
    end = ((subtask_index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def subtask_for_key_group(max_parallelism: int, parallelism: int, key_group_id: int) -> int:
    """The subtask index that owns ``key_group_id``."""
    return key_group_id * parallelism // max_parallelism


def subtask_table(max_parallelism: int, parallelism: int) -> list[int]:
    """``table[g]`` is the subtask owning key group ``g`` (a list lookup beats arithmetic in loops)."""
    return [g * parallelism // max_parallelism for g in range(max_parallelism)]

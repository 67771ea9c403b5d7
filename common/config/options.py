"""Every configuration key the runtime reads, with its type, default and meaning.

Keys follow Flink's names wherever Flink has one, so a Flink user finds them where they expect.
``docs/configuration.md`` is generated from this table (``statectl config docs``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from keyedstate.common.claim_mode import RecoveryClaimMode, claim_mode_parser
from keyedstate.common.config._option import ConfigOption
from keyedstate.common.config._parsers import (
    bool_parser,
    duration_parser,
    enum_parser,
    float_parser,
    int_parser,
    memory_at_least,
    memory_parser,
    optional_duration_parser,
    port_parser,
    port_range_parser,
    string_parser,
)

ALL: list[ConfigOption[Any]] = []


def _opt(key: str, parser: Any, default: Any, type_name: str, description: str, **kw: Any) -> ConfigOption[Any]:
    option: ConfigOption[Any] = ConfigOption(key, parser, default, description, type_name, **kw)
    ALL.append(option)
    return option


# --- JobManager -------------------------------------------------------------------------------
JOBMANAGER_ADDRESS = _opt(
    "jobmanager.rpc.address",
    string_parser,
    "127.0.0.1",
    "string",
    "Host name or IP of the JobManager; TaskManagers, clients and statectl connect here.",
)
JOBMANAGER_PORT = _opt(
    "jobmanager.rpc.port",
    port_parser,
    6123,
    "int",
    "gRPC port of the JobManager. 0 picks a free port (printed at start-up).",
)
JOBMANAGER_BIND_HOST = _opt(
    "jobmanager.bind-host",
    string_parser,
    None,
    "string",
    "Interface the JobManager listens on; defaults to jobmanager.rpc.address.",
)
REST_PORT = _opt(
    "rest.port",
    int_parser(-1, 65535),
    8081,
    "int",
    "HTTP port of the JobManager's web UI and REST API; -1 disables it, 0 picks a free port.",
)
WEB_REFRESH_INTERVAL = _opt(
    "web.refresh-interval",
    duration_parser,
    3_000,
    "duration",
    "How often the JobManager's web page (on rest.port) reloads what it shows.",
)
WEB_CHECKPOINTS_HISTORY = _opt(
    "web.checkpoints.history",
    int_parser(1, 10_000),
    10,
    "int",
    "How many recent checkpoints each job's history keeps for the web UI, the REST API and statectl checkpoint list.",
)

# --- TaskManager ------------------------------------------------------------------------------
TASKMANAGER_HOST = _opt(
    "taskmanager.host",
    string_parser,
    "127.0.0.1",
    "string",
    "Address the TaskManager reports to the JobManager; clients connect to it.",
)
TASKMANAGER_BIND_HOST = _opt(
    "taskmanager.bind-host",
    string_parser,
    None,
    "string",
    "Interface the TaskManager listens on; defaults to taskmanager.host.",
)
TASKMANAGER_PORT = _opt(
    "taskmanager.rpc.port",
    port_parser,
    0,
    "int",
    "gRPC port of the TaskManager. 0 picks a free port, which is reported to the JobManager.",
)
MAX_TASK_SLOTS = 4096
"""The most slots one TaskManager may offer (the JobManager refuses a registration above it)."""
TASKMANAGER_SLOTS = _opt(
    "taskmanager.numberOfTaskSlots",
    int_parser(1, MAX_TASK_SLOTS),
    1,
    "int",
    "Slots this TaskManager offers; each hosts the keyed state of one (job, operator, subtask).",
)
TASKMANAGER_RESOURCE_ID = _opt(
    "taskmanager.resource-id",
    string_parser,
    None,
    "string",
    "Stable id of this TaskManager. Defaults to one derived from the host and the local state "
    "directory, so a restarted TaskManager is recognised and can recover from local state.",
)
TASKMANAGER_REGISTRATION_TIMEOUT = _opt(
    "taskmanager.registration.timeout",
    duration_parser,
    5 * 60_000,
    "duration",
    "How long a TaskManager keeps trying to reach the JobManager at start-up before it exits with an error.",
)
MANAGED_MEMORY = _opt(
    "taskmanager.memory.managed.size",
    memory_parser,
    256 << 20,
    "memory",
    "Memory budget for all RocksDB instances of this TaskManager: the shared block cache plus "
    "every memtable (capped by a WriteBufferManager).",
)
MALLOC_ARENA_MAX = _opt(
    "taskmanager.memory.malloc-arena-max",
    int_parser(0),
    2,
    "int",
    "glibc malloc arenas for the TaskManager process (0 leaves glibc's default of 8 per core). Per-thread "
    "arenas fragment memory until RSS outgrows taskmanager.memory.managed.size; MALLOC_ARENA_MAX in the "
    "environment wins over this key.",
)

# --- Heartbeats -------------------------------------------------------------------------------
HEARTBEAT_INTERVAL = _opt(
    "heartbeat.interval",
    duration_parser,
    10_000,
    "duration",
    "How often TaskManagers send heartbeats to the JobManager.",
)
HEARTBEAT_TIMEOUT = _opt(
    "heartbeat.timeout",
    duration_parser,
    50_000,
    "duration",
    "A TaskManager with no heartbeat for this long is declared lost.",
)
HEARTBEAT_CONNECTION_LOSS = _opt(
    "heartbeat.connection-loss-detection",
    bool_parser,
    True,
    "bool",
    "Declare a TaskManager lost as soon as the JobManager's connection to it breaks (reconnecting is "
    "refused after it was up, as after kill -9), without waiting for heartbeat.timeout.",
)

# --- State backends ---------------------------------------------------------------------------
_FORST_REFUSAL = (
    "ForSt keeps the working state on remote storage, and this runtime's slots keep it on local "
    "disk (rocksdb) or in memory (hashmap). For fast recovery of large state use "
    "execution.state-recovery.from-local (local recovery) and changelog checkpoints "
    "(state.changelog.enabled); set state.backend.type: rocksdb"
)
STATE_BACKEND = _opt(
    "state.backend.type",
    enum_parser(
        "rocksdb",
        "hashmap",
        refused=dict.fromkeys(
            ("forst", "forststatebackend", "org.apache.flink.state.forst.forststatebackend"), _FORST_REFUSAL
        ),
    ),
    "rocksdb",
    "enum",
    "rocksdb (embedded RocksDB per slot, state may exceed memory) or hashmap (in memory, same "
    "semantics). Unlike Flink, the default is rocksdb. forst (remote working state) is refused with "
    "the alternatives. Flink's legacy values (jobmanager, filesystem) and class names (HashMapStateBackend, "
    "EmbeddedRocksDBStateBackend, MemoryStateBackend, FsStateBackend, RocksDBStateBackend, with or "
    "without their org.apache.flink package) are read as hashmap or rocksdb with a deprecation warning.",
    fallback_keys=("state.backend",),
    legacy_values={
        "jobmanager": "hashmap",
        "filesystem": "hashmap",
        "hashmapstatebackend": "hashmap",
        "hashmapstatebackendfactory": "hashmap",
        "memorystatebackend": "hashmap",
        "memorystatebackendfactory": "hashmap",
        "fsstatebackend": "hashmap",
        "fsstatebackendfactory": "hashmap",
        "embeddedrocksdbstatebackend": "rocksdb",
        "embeddedrocksdbstatebackendfactory": "rocksdb",
        "rocksdbstatebackend": "rocksdb",
        "rocksdbstatebackendfactory": "rocksdb",
    },
    legacy_notes=dict.fromkeys(
        ("jobmanager", "memorystatebackend", "memorystatebackendfactory"),
        "Flink's MemoryStateBackend also kept checkpoints in the JobManager's memory; for that, "
        "also set execution.checkpointing.storage: jobmanager",
    ),
)
ROCKSDB_LOCALDIR = _opt(
    "state.backend.rocksdb.localdir",
    string_parser,
    str(Path(tempfile.gettempdir()) / "keyedstate"),
    "string",
    "Directory for the working state of every slot (one instance directory per slot).",
)
ROCKSDB_BLOCK_CACHE = _opt(
    "state.backend.rocksdb.block.cache-size",
    memory_parser,
    None,
    "memory",
    "Size of the block cache shared by all slots. Default: the managed memory minus the write buffers.",
)
ROCKSDB_WRITEBUFFER_SIZE = _opt(
    "state.backend.rocksdb.writebuffer.size",
    memory_parser,
    64 << 20,
    "memory",
    "Size of one memtable (per column family).",
)
ROCKSDB_WRITEBUFFER_COUNT = _opt(
    "state.backend.rocksdb.writebuffer.count",
    int_parser(1, 64),
    2,
    "int",
    "Memtables per column family before writes stall.",
)
ROCKSDB_WRITE_BUFFER_RATIO = _opt(
    "state.backend.rocksdb.memory.write-buffer-ratio",
    float_parser(0.0),
    0.5,
    "float",
    "Share of the managed memory all memtables may use together (the WriteBufferManager limit).",
)
ROCKSDB_THREADS = _opt(
    "state.backend.rocksdb.thread.num",
    int_parser(1, 64),
    2,
    "int",
    "Background flush and compaction threads per RocksDB instance.",
)
ROCKSDB_BLOOM = _opt(
    "state.backend.rocksdb.use-bloom-filter",
    bool_parser,
    True,
    "bool",
    "Bloom filters on SST files; point reads of absent keys skip disk. Flink's default is false.",
)
ROCKSDB_TRANSFER_THREADS = _opt(
    "state.backend.rocksdb.checkpoint.transfer.thread.num",
    int_parser(1, 64),
    4,
    "int",
    "Parallel file uploads and downloads per slot during checkpoints and restores.",
)
TASKMANAGER_TRANSFER_PROCESSES = _opt(
    "taskmanager.checkpoint.transfer.processes",
    int_parser(0, 64),
    1,
    "int",
    "Worker processes that upload checkpoint files, so transfers never share the serving process's "
    "GIL; each runs its own file system client. Restores download through one more process at the "
    "TaskManager's priority. 0 runs all transfers inside the TaskManager process.",
)
TASKMANAGER_TRANSFER_NICE = _opt(
    "taskmanager.checkpoint.transfer.nice",
    int_parser(0, 19),
    10,
    "int",
    "CPU niceness of the checkpoint transfer processes (of the upload threads when they run "
    "in-process): checkpoint uploads yield a contended CPU to serving. Restores keep normal priority.",
)

TASKMANAGER_SLOT_PROCESSES = _opt(
    "taskmanager.slot-processes",
    int_parser(1, 64),
    1,
    "int",
    "Processes serving this TaskManager's slots. 1 serves every slot in the TaskManager process; "
    "N > 1 starts N slot processes (slot i in process i mod N), each with its own GIL, its own "
    "client port (the JobManager routes clients straight to it) and 1/N of "
    "taskmanager.memory.managed.size; the TaskManager process keeps the JobManager connection "
    "and the lease. Set it to about the host's cores per TaskManager.",
)

# --- Limits (this runtime's own keys; Flink has none) -----------------------------------------
MAX_KEY_BYTES = _opt(
    "state.limits.max-key-bytes",
    memory_at_least(1),
    64 << 10,
    "memory",
    "Largest accepted key (and map user key); larger ones are refused with INVALID_ARGUMENT.",
)
MAX_VALUE_BYTES = _opt(
    "state.limits.max-value-bytes",
    memory_at_least(1),
    16 << 20,
    "memory",
    "Largest accepted value or list element; larger ones are refused with INVALID_ARGUMENT.",
)
MAX_LIST_RESPONSE_BYTES = _opt(
    "state.limits.list.max-response-bytes",
    memory_at_least(1),
    64 << 20,
    "memory",
    "ListGet (ListState.get) refuses lists larger than this and names ListState.scan(), which streams a list of any size.",
)
MAX_LIST_ELEMENTS = _opt(
    "state.limits.list.max-elements",
    int_parser(1),
    10_000_000,
    "int",
    "Appends that would grow one list past this many elements are refused with RESOURCE_EXHAUSTED.",
)
RPC_MAX_MESSAGE = _opt(
    "rpc.max-message-size",
    memory_parser,
    256 << 20,
    "memory",
    "Largest gRPC message accepted or sent (requests carrying thousands of keys).",
)
RPC_WORKERS = _opt("rpc.server.threads", int_parser(1, 256), 16, "int", "Threads serving gRPC calls in each daemon.")

# --- TTL --------------------------------------------------------------------------------------
TTL_CLEANUP_INTERVAL = _opt(
    "state.backend.ttl.cleanup-interval",
    duration_parser,
    60_000,
    "duration",
    "How often each slot sweeps expired TTL entries in the background (expired values are never "
    "returned in between). 0 disables the sweep.",
)
TTL_CLEANUP_BATCH = _opt(
    "state.backend.ttl.cleanup-batch",
    int_parser(1),
    10_000,
    "int",
    "Entries examined per sweep step, so a sweep never blocks serving for long.",
)

# --- Parallelism ------------------------------------------------------------------------------
MAX_PARALLELISM = _opt(
    "pipeline.max-parallelism",
    int_parser(1, 1 << 15),
    128,
    "int",
    "Number of key groups of a job (the upper bound of its parallelism); fixed for the job's life.",
)

# --- Checkpointing ----------------------------------------------------------------------------
CHECKPOINTS_DIR = _opt(
    "state.checkpoints.dir",
    string_parser,
    None,
    "string",
    "Where checkpoints go with filesystem storage: file://, s3:// or hdfs:// (any fsspec URL). Layout (Flink's): "
    "<dir>/<job-id>/{chk-<n>/_metadata, shared/, taskowned/}; shared/ and taskowned/ are created at job start, "
    "and nothing in taskowned/ (TaskManager-owned state) is ever deleted by retention or gc.",
)
CHECKPOINT_STORAGE = _opt(
    "execution.checkpointing.storage",
    enum_parser("filesystem", "jobmanager"),
    "filesystem",
    "enum",
    "Where checkpoints are kept. filesystem: files under state.checkpoints.dir. jobmanager (Flink's "
    "JobManagerCheckpointStorage): TaskManagers send their snapshots inline in their acknowledgements and the "
    "JobManager keeps completed checkpoints in its memory, no files; they restore and fail over while that "
    "JobManager lives, so it is refused with high-availability.type; savepoints still go to their directory. "
    "For small state, tests and development. Flink's class names FileSystemCheckpointStorage and "
    "JobManagerCheckpointStorage (with or without their org.apache.flink package) are read with a deprecation warning.",
    fallback_keys=("state.checkpoint-storage",),
    legacy_values={
        "filesystemcheckpointstorage": "filesystem",
        "filesystemcheckpointstoragefactory": "filesystem",
        "jobmanagercheckpointstorage": "jobmanager",
        "jobmanagercheckpointstoragefactory": "jobmanager",
    },
)
JOBMANAGER_STORAGE_MAX_STATE_SIZE = _opt(
    "execution.checkpointing.jobmanager-storage.max-state-size",
    memory_at_least(1),
    5 << 20,
    "memory",
    "With execution.checkpointing.storage: jobmanager, the largest snapshot one slot may send inline "
    "(Flink's JobManagerCheckpointStorage maxStateSize, 5 MB by default, which Flink sets only in code). "
    "A larger one declines the checkpoint with reason STATE_SIZE_LIMIT_EXCEEDED; use filesystem storage then.",
)
SAVEPOINTS_DIR = _opt("state.savepoints.dir", string_parser, None, "string", "Default target directory of savepoints.")
CHECKPOINT_INTERVAL = _opt(
    "execution.checkpointing.interval",
    optional_duration_parser,
    None,
    "duration",
    "Periodic checkpoint interval; unset disables periodic checkpoints (epoch commits can still checkpoint).",
)
CHECKPOINT_TIMEOUT = _opt(
    "execution.checkpointing.timeout",
    duration_parser,
    10 * 60_000,
    "duration",
    "A checkpoint not completed within this time is aborted (reason CHECKPOINT_EXPIRED).",
)
CHECKPOINT_MAX_CONCURRENT = _opt(
    "execution.checkpointing.max-concurrent-checkpoints",
    int_parser(1),
    1,
    "int",
    "Checkpoints that may be in progress at once.",
)
CHECKPOINT_MIN_PAUSE = _opt(
    "execution.checkpointing.min-pause",
    duration_parser,
    0,
    "duration",
    "Minimum time between the end of one checkpoint and the start of the next.",
)
CHECKPOINT_TOLERABLE_FAILURES = _opt(
    "execution.checkpointing.tolerable-failed-checkpoints",
    int_parser(0),
    0,
    "int",
    "Consecutive failed checkpoints tolerated; one more fails the job over to its latest completed checkpoint.",
)
CHECKPOINT_NUM_RETAINED = _opt(
    "execution.checkpointing.num-retained",
    int_parser(1),
    1,
    "int",
    "Completed checkpoints kept; older ones are deleted with the files only they used.",
    fallback_keys=("state.checkpoints.num-retained",),
)
CHECKPOINT_INCREMENTAL = _opt(
    "execution.checkpointing.incremental",
    bool_parser,
    False,
    "bool",
    "Incremental checkpoints: upload only SST files not already in shared/.",
    fallback_keys=("state.backend.incremental",),
)
CHECKPOINT_COMMIT_MODE = _opt(
    "execution.checkpointing.commit-mode",
    enum_parser("sync", "overlapped"),
    "sync",
    "enum",
    "How an epoch (a Spark micro-batch of foreach_batch) commits. sync: foreachBatch returns after every slot "
    "applied the epoch and a completed checkpoint holds it. overlapped (docs/exactly-once.md, Overlapped commits): "
    "every slot writes its change set to <state.checkpoints.dir>/<job>/changelog/ at Prepare, the JobManager "
    "writes the epoch's decision there create-only and foreachBatch returns; the apply and the checkpoint "
    "overlap the next batch (whose calls wait until the slot holds the previous epoch), and restores replay the "
    "decided epochs above their checkpoint. Needs execution.checkpointing.storage: filesystem with "
    "state.checkpoints.dir.",
)
STATE_RECOVERY_PATH = _opt(
    "execution.state-recovery.path",
    string_parser,
    None,
    "string",
    "Checkpoint or savepoint a submitted job restores from.",
)
CLAIM_MODE = _opt(
    "execution.state-recovery.claim-mode",
    claim_mode_parser,
    RecoveryClaimMode.NO_CLAIM,
    "enum",
    "Who owns the files of the checkpoint or savepoint a job is submitted or restored from: NO_CLAIM (the user: the "
    "job never deletes them, and its first checkpoint after the restore is full) or CLAIM (the job: it deletes the "
    "snapshot once subsumed, and its first checkpoint stays incremental when the snapshot is a checkpoint of its own "
    "directory). LEGACY was removed in Flink 2.0 and is refused.",
    fallback_keys=("execution.savepoint-restore-mode",),
)
LOCAL_RECOVERY = _opt(
    "execution.state-recovery.from-local",
    bool_parser,
    False,
    "bool",
    "Keep a local copy of the latest completed checkpoint and restore from it on the same host.",
    fallback_keys=("state.backend.local-recovery",),
)

# --- Changelog state backend -------------------------------------------------------------------
CHANGELOG_ENABLED = _opt(
    "state.changelog.enabled",
    bool_parser,
    False,
    "bool",
    "Changelog checkpoints: each committed epoch is first written to a local changelog segment, and a "
    "checkpoint uploads only the segments since the previous one on top of the last materialized snapshot.",
    fallback_keys=("state.backend.changelog.enabled",),
)
CHANGELOG_STORAGE = _opt(
    "state.changelog.storage",
    enum_parser("filesystem"),
    "filesystem",
    "enum",
    "Where changelog segments are made durable: filesystem (any fsspec URL, see "
    "state.changelog.dstl.dfs.base-path). Flink's in-memory storage is not offered: it cannot survive a failover.",
    fallback_keys=("state.backend.changelog.storage",),
)
CHANGELOG_BASE_PATH = _opt(
    "state.changelog.dstl.dfs.base-path",
    string_parser,
    None,
    "string",
    "Base path of the uploaded changelog segments. Only unset is accepted: segments go to the job's shared/ "
    "directory under state.checkpoints.dir, where retention and gc count them with the snapshot files.",
)
CHANGELOG_MATERIALIZE_INTERVAL = _opt(
    "state.changelog.periodic-materialize.interval",
    duration_parser,
    10 * 60_000,
    "duration",
    "How often a slot materializes its state (an incremental snapshot) in the background, after which "
    "checkpoints reference the snapshot and no longer the segments before it.",
    fallback_keys=("state.backend.changelog.periodic-materialize.interval",),
)
CHANGELOG_MAX_FAILURES = _opt(
    "state.changelog.max-failures-allowed",
    int_parser(0),
    3,
    "int",
    "Consecutive failed materializations a slot tolerates (checkpoints meanwhile reference the previous "
    "materialization); the next failure fails the slot's job over, as a task failure: the restart strategy "
    "restarts it from its latest completed checkpoint. A successful materialization resets the count.",
    fallback_keys=("state.backend.changelog.max-failures-allowed",),
)

# --- Restart strategy -------------------------------------------------------------------------
RESTART_STRATEGY = _opt(
    "restart-strategy.type",
    enum_parser("fixed-delay", "exponential-delay", "none", "disable", "off"),
    "exponential-delay",
    "enum",
    "How a job restarts after a TaskManager loss: fixed-delay, exponential-delay or none.",
    fallback_keys=("restart-strategy",),
)
RESTART_FIXED_ATTEMPTS = _opt(
    "restart-strategy.fixed-delay.attempts",
    int_parser(0),
    1,
    "int",
    "Restarts allowed before the job fails (fixed-delay).",
)
RESTART_FIXED_DELAY = _opt(
    "restart-strategy.fixed-delay.delay", duration_parser, 1_000, "duration", "Delay before each restart (fixed-delay)."
)
RESTART_EXP_INITIAL = _opt(
    "restart-strategy.exponential-delay.initial-backoff",
    duration_parser,
    1_000,
    "duration",
    "First restart delay (exponential-delay).",
)
RESTART_EXP_MAX = _opt(
    "restart-strategy.exponential-delay.max-backoff",
    duration_parser,
    60_000,
    "duration",
    "Largest restart delay (exponential-delay).",
)
RESTART_EXP_MULTIPLIER = _opt(
    "restart-strategy.exponential-delay.backoff-multiplier",
    float_parser(1.0),
    2.0,
    "float",
    "Factor applied to the delay after each restart (exponential-delay).",
)
RESTART_EXP_ATTEMPTS = _opt(
    "restart-strategy.exponential-delay.attempts-before-reset-backoff",
    int_parser(0),
    1_000_000,
    "int",
    "Restarts allowed before the job fails (exponential-delay).",
)

# --- High availability ------------------------------------------------------------------------
HA_TYPE = _opt(
    "high-availability.type",
    enum_parser("none", "filesystem"),
    "none",
    "enum",
    "filesystem: keep jobs, completed-checkpoint pointers and the checkpoint id counter under "
    "high-availability.storageDir so a restarted JobManager resumes every job.",
    fallback_keys=("high-availability",),
)
HA_STORAGE_DIR = _opt(
    "high-availability.storageDir",
    string_parser,
    None,
    "string",
    "Durable directory (any fsspec URL) for JobManager metadata: job records, completed-checkpoint "
    "pointers, checkpoint id counters and the leadership lease.",
)
HA_CLUSTER_ID = _opt(
    "high-availability.cluster-id",
    string_parser,
    "default",
    "string",
    "Names this cluster: its subdirectory of high-availability.storageDir, so several clusters can share it, "
    "and the cluster a TaskManager registers with: a JobManager refuses TaskManagers of another cluster id. "
    "Give every cluster on a shared host or network its own id.",
)
HA_LEASE_CHECK_INTERVAL = _opt(
    "high-availability.filesystem.lease-check-interval",
    duration_parser,
    5_000,
    "duration",
    "How often a JobManager checks that no newer JobManager took over its high-availability directory; "
    "one that finds a newer leader stops at once (fencing).",
)
SLOT_REQUEST_TIMEOUT = _opt(
    "slot.request.timeout",
    duration_parser,
    300_000,
    "duration",
    "How long a recovering job waits for enough free slots (TaskManagers re-registering after a "
    "JobManager restart) before it falls back to its restart strategy.",
)

# --- S3 (Flink's s3 filesystem keys; the AWS environment variables also work) -----------------
S3_ENDPOINT = _opt("s3.endpoint", string_parser, None, "string", "S3 endpoint URL, for MinIO or other S3 APIs.")
S3_ACCESS_KEY = _opt(
    "s3.access-key",
    string_parser,
    None,
    "string",
    "S3 access key id (secret: set it in the config file or as AWS_ACCESS_KEY_ID, not with -D).",
    secret=True,
)
S3_SECRET_KEY = _opt(
    "s3.secret-key",
    string_parser,
    None,
    "string",
    "S3 secret access key (secret: set it in the config file or as AWS_SECRET_ACCESS_KEY, not with -D).",
    secret=True,
)
S3_PATH_STYLE = _opt("s3.path.style.access", bool_parser, False, "bool", "Path-style bucket addressing.")
S3_REGION = _opt("s3.region", string_parser, None, "string", "S3 region.")

# --- Security: identity and authorization (docs/security.md) ----------------------------------
AUTH_ENABLED = _opt(
    "security.auth.enabled",
    bool_parser,
    False,
    "bool",
    "Require an identity on every gRPC call: a bearer token (security.auth.tokens-file) or, on the internal "
    "mTLS plane, a peer certificate. Calls without one are UNAUTHENTICATED; calls the identity's role or job "
    "scope does not allow are PERMISSION_DENIED.",
)
AUTH_TOKENS_FILE = _opt(
    "security.auth.tokens-file",
    string_parser,
    None,
    "string",
    "Server side (JobManager and TaskManagers): YAML file listing the accepted tokens by SHA-256 hash, each with "
    "a name, a role (admin, writer, reader, taskmanager, jobmanager) and the jobs it may touch ('*' for all). "
    "Re-read when it changes. Create entries with `statectl auth token`.",
)
AUTH_TOKEN_FILE = _opt(
    "security.auth.token-file",
    string_parser,
    None,
    "string",
    "Client side (StateClient, statectl, Spark helpers, and each daemon's own calls to the other daemons): the "
    "file holding this process's token. Without it the token comes from KEYEDSTATE_TOKEN_FILE or "
    "KEYEDSTATE_TOKEN in the environment; never put a token on the command line.",
)

# --- Metrics ----------------------------------------------------------------------------------
PROM_PORT = _opt(
    "metrics.reporter.prom.port",
    port_range_parser,
    (9249, 9260),
    "port range",
    "Port or range (9250-9260) of the Prometheus HTTP endpoint; the first free port is used. 0 picks any free port; -1 disables.",
)

# RocksDB native metrics, switched per property as in Flink (state.backend.rocksdb.metrics.<property>).
# Flink switches them all off by default; here the ones deploy/'s dashboards and alerts use are on,
# since a property is read only when scraped and costs microseconds.
_ROCKSDB_METRICS_ON = [
    "num-immutable-mem-table",
    "mem-table-flush-pending",
    "compaction-pending",
    "background-errors",
    "cur-size-all-mem-tables",
    "estimate-num-keys",
    "estimate-live-data-size",
    "total-sst-files-size",
    "estimate-pending-compaction-bytes",
    "num-running-compactions",
    "num-running-flushes",
    "actual-delayed-write-rate",
    "is-write-stopped",
    "block-cache-capacity",
    "block-cache-usage",
    "block-cache-pinned-usage",
]
_ROCKSDB_METRICS_OFF = [
    "cur-size-active-mem-table",
    "size-all-mem-tables",
    "num-entries-active-mem-table",
    "num-entries-imm-mem-tables",
    "num-deletes-active-mem-table",
    "num-deletes-imm-mem-tables",
    "estimate-table-readers-mem",
    "num-snapshots",
    "num-live-versions",
    "live-sst-files-size",
]
ROCKSDB_METRICS: dict[str, ConfigOption[Any]] = {
    prop: _opt(
        f"state.backend.rocksdb.metrics.{prop}",
        bool_parser,
        prop in _ROCKSDB_METRICS_ON,
        "bool",
        f"Export RocksDB's rocksdb.{prop} of every column family of every slot (docs/metrics.md).",
    )
    for prop in sorted(_ROCKSDB_METRICS_ON + _ROCKSDB_METRICS_OFF)
}
ROCKSDB_METRICS_COLUMN_FAMILY_AS_VARIABLE = _opt(
    "state.backend.rocksdb.metrics.column-family-as-variable",
    bool_parser,
    True,
    "bool",
    "RocksDB native metrics carry the column family (the state name) as the label column_family, so one "
    "dashboard query covers every state; false puts it into the metric's name, as Flink's default does.",
)

# --- Security: transport (docs/security.md) ---------------------------------------------------
# Two planes, as in Flink: "internal" (JobManager <-> TaskManager, always mutual TLS) and "rest"
# (clients, statectl, the PySpark helpers, and the HTTP endpoints). Certificates are PEM files,
# re-read when they change, so rotating them needs no restart.
SSL_ENABLED = _opt(
    "security.ssl.enabled",
    bool_parser,
    False,
    "bool",
    "Turns on TLS for both planes (the default of security.ssl.internal.enabled and security.ssl.rest.enabled).",
)
SSL_INTERNAL_ENABLED = _opt(
    "security.ssl.internal.enabled",
    bool_parser,
    None,
    "bool",
    "Mutual TLS between the JobManager and the TaskManagers: only a daemon with a certificate of the cluster's CA "
    "(security.ssl.internal.ca) can register, heartbeat, acknowledge checkpoints or be deployed to. The internal "
    "services then listen on their own ports (jobmanager.internal.port, taskmanager.internal.port). "
    "Default: security.ssl.enabled.",
)
SSL_INTERNAL_CERT = _opt(
    "security.ssl.internal.cert",
    string_parser,
    None,
    "path",
    "PEM certificate (chain) this daemon presents on the internal plane, to its peers as server and as client. "
    "Flink: the key entry of security.ssl.internal.keystore.",
)
SSL_INTERNAL_KEY = _opt(
    "security.ssl.internal.key",
    string_parser,
    None,
    "path",
    "PEM private key (unencrypted) of security.ssl.internal.cert. Flink: security.ssl.internal.keystore with "
    "security.ssl.internal.key-password.",
)
SSL_INTERNAL_CA = _opt(
    "security.ssl.internal.ca",
    string_parser,
    None,
    "path",
    "PEM CA certificate(s) the internal plane trusts; a peer must present a certificate issued by one of them. "
    "Flink: security.ssl.internal.truststore.",
)
SSL_INTERNAL_SERVER_NAME = _opt(
    "security.ssl.internal.server-name",
    string_parser,
    None,
    "string",
    "Name the internal plane expects in its peers' server certificates instead of the host it connects to: one "
    "shared cluster certificate (Flink's advice for the internal plane) names the cluster, not every host.",
)
SSL_REST_ENABLED = _opt(
    "security.ssl.rest.enabled",
    bool_parser,
    None,
    "bool",
    "TLS for clients (StateClient, PySpark helpers, statectl) and the metrics HTTP endpoint. Default: security.ssl.enabled.",
)
SSL_REST_CERT = _opt(
    "security.ssl.rest.cert",
    string_parser,
    None,
    "path",
    "PEM certificate (chain) of the daemons' client-facing ports and metrics endpoint; on a client, its own "
    "certificate (needed when security.ssl.rest.authentication-enabled). Flink: security.ssl.rest.keystore.",
)
SSL_REST_KEY = _opt(
    "security.ssl.rest.key",
    string_parser,
    None,
    "path",
    "PEM private key (unencrypted) of security.ssl.rest.cert. Flink: security.ssl.rest.keystore with "
    "security.ssl.rest.key-password.",
)
SSL_REST_CA = _opt(
    "security.ssl.rest.ca",
    string_parser,
    None,
    "path",
    "PEM CA certificate(s): on a client, the CAs trusted to sign the servers' certificates (default: the system's); "
    "on a daemon, the CAs that sign client certificates (needed with security.ssl.rest.authentication-enabled). "
    "Flink: security.ssl.rest.truststore.",
)
SSL_REST_AUTHENTICATION = _opt(
    "security.ssl.rest.authentication-enabled",
    bool_parser,
    False,
    "bool",
    "Mutual TLS on the client plane: clients and metrics scrapers must present a certificate issued by "
    "security.ssl.rest.ca.",
)
SSL_REST_SERVER_NAME = _opt(
    "security.ssl.rest.server-name",
    string_parser,
    None,
    "string",
    "On a client: the name expected in the servers' certificates instead of the host connected to.",
)
SSL_RELOAD_INTERVAL = _opt(
    "security.ssl.reload-interval",
    duration_parser,
    1_000,
    "duration",
    "How often long-lived client channels check their certificate files for changes (servers check on every "
    "new connection).",
)
JOBMANAGER_INTERNAL_PORT = _opt(
    "jobmanager.internal.port",
    port_parser,
    None,
    "int",
    "gRPC port of the JobManager's internal services (ResourceManager, CheckpointCoordinatorGateway). Unset: "
    "they share jobmanager.rpc.port while TLS is off on both planes, and use 6124 when TLS is on. "
    "TaskManagers connect here; 0 picks a free port (TaskManagers must then be given the port).",
)
TASKMANAGER_INTERNAL_PORT = _opt(
    "taskmanager.internal.port",
    port_parser,
    None,
    "int",
    "gRPC port of the TaskManager's internal service (TaskExecutor). Unset: it shares taskmanager.rpc.port while "
    "TLS is off on both planes, and picks a free port when TLS is on; reported to the JobManager at registration.",
)
PROTECTED_MODE = _opt(
    "security.protected-mode",
    bool_parser,
    True,
    "bool",
    "Refuse to start a daemon that would listen on a non-loopback address with neither TLS nor authentication. "
    "Set false only on a network where every host that can reach the ports is trusted.",
)

# --- Client -----------------------------------------------------------------------------------
CLIENT_TIMEOUT = _opt(
    "client.rpc.timeout", duration_parser, 60_000, "duration", "Deadline of one client call to a TaskManager."
)
CLIENT_RETRIES = _opt(
    "client.retry.max-attempts",
    int_parser(1),
    8,
    "int",
    "Attempts of an idempotent client call on UNAVAILABLE or stale routing.",
)
CLIENT_RETRY_BACKOFF = _opt(
    "client.retry.backoff",
    duration_parser,
    100,
    "duration",
    "First retry delay of a client call; doubles per attempt up to 5 s.",
)
CLIENT_BATCH_SIZE = _opt(
    "client.batch.size", int_parser(1), 2000, "int", "Keys per request the client sends to one TaskManager."
)
CLIENT_MAX_IN_FLIGHT = _opt(
    "client.batch.max-in-flight",
    int_parser(1),
    4,
    "int",
    "Requests per TaskManager the client keeps in flight (pipelining).",
)


def cluster_id(conf: Any) -> str:
    """``high-availability.cluster-id``, validated: it names a directory and is compared at registration."""
    from keyedstate.common.errors import ConfigError, InvalidArgumentError
    from keyedstate.common.ids import validate_name

    try:
        return validate_name("high-availability.cluster-id", str(conf.get(HA_CLUSTER_ID)).strip("/"))
    except InvalidArgumentError as exc:
        raise ConfigError(exc.message) from None


def checkpoints_in_jobmanager_memory(conf: Any) -> bool:
    """True when ``conf`` keeps checkpoints in the JobManager's memory; ConfigError if that cannot work.

    A JobManager that restarts under high availability resumes its jobs from their latest
    checkpoints, which a memory-held checkpoint does not survive: the combination is refused
    at start-up (and at submission, for a job's own config) instead of failing at recovery.
    """
    from keyedstate.common.errors import ConfigError

    if conf.get(CHECKPOINT_STORAGE) != "jobmanager":
        return False
    if conf.get(HA_TYPE) != "none":
        raise ConfigError(
            f"{CHECKPOINT_STORAGE.key}: jobmanager keeps checkpoints in the JobManager's memory, which a restarted "
            f"JobManager cannot find, so it cannot be combined with {HA_TYPE.key}: {conf.get(HA_TYPE)}; set "
            f"{CHECKPOINT_STORAGE.key}: filesystem with {CHECKPOINTS_DIR.key}, or {HA_TYPE.key}: none"
        )
    return True


def by_key() -> dict[str, ConfigOption[Any]]:
    return {o.key: o for o in ALL}


def docs_markdown() -> str:
    """The configuration reference as a Markdown table."""
    lines = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for o in ALL:
        default = "(none)" if o.default is None else o.default
        if o.type_name == "memory" and isinstance(default, int):
            default = f"{default >> 20}mb" if default >= 1 << 20 else f"{default >> 10}kb"
        if o.type_name == "duration" and isinstance(default, int):
            default = f"{default} ms"
        if o.key == ROCKSDB_LOCALDIR.key:
            default = "<tmp>/keyedstate"
        legacy = f" Legacy: {', '.join('`' + k + '`' for k in o.fallback_keys)}." if o.fallback_keys else ""
        lines.append(f"| `{o.key}` | {o.type_name} | `{default}` | {o.description}{legacy} |")
    return "\n".join(lines) + "\n"

from tests.integration.checkpoints.conftest import *
import pytest
@pytest.mark.parametrize("i", range(30))
def test_dbg(checkpoint_cluster, i):
    cc = checkpoint_cluster("file", "rocksdb")
    client = cc.client()
    client.submit_job(JOB, operators(2), max_parallelism=MAX_P)
    work = Workload(client)
    keys = key_names(1500)
    work.write(keys, "a")
    work.write(keys[::2], "b")
    assert_state_equals(work.read(), work.reference)

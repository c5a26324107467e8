"""Fixtures of the multi-node tests (test_launcher.py, test_stall.py, test_preempt.py): a loopback-only network
namespace, two loopback "nodes" served by a private sshd (tests/fixtures/sshd_fixture.py), and their hostfile.

Each is module-scoped: a test file starts its sshd once and stops it when its last test is done. The launch itself
and finding a job's ranks: tests/fixtures/launch_cluster.py.
"""

import pytest

from tests.fixtures.sshd_fixture import IsolatedNetwork, LoopbackCluster, missing_binaries


@pytest.fixture(scope="module")
def netns():
    """A command prefix that runs inside a loopback-only network namespace (empty where not permitted)."""
    with IsolatedNetwork() as net:
        yield net.prefix


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, netns):
    missing = missing_binaries()
    if missing:
        pytest.skip(f"two-node runs need {', '.join(missing)} (apt-get install openssh-server pdsh openmpi-bin)")
    with LoopbackCluster(str(tmp_path_factory.mktemp("sshd")), prefix=netns) as c:
        yield c


@pytest.fixture(scope="module")
def hostfile(tmp_path_factory):
    path = tmp_path_factory.mktemp("hosts") / "two_nodes"
    path.write_text("# two loopback nodes served by tests/fixtures/sshd_fixture.py\n127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    return str(path)

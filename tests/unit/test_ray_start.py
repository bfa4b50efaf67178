"""An embedded Ray node whose raylet misses Ray's 30 s registration deadline (a machine with every core busy) is
started again, the processes of the failed start gone first; any other error of ray.init is raised at once."""
import subprocess

import pytest
import ray

from rlcore.workers.group import RAY_START_TRIES, start_local_ray

TIMED_OUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                      "failed to startup or the GCS has become overloaded.")


class FlakyInit:
    """ray.init that starts a process (Ray's GCS and raylet, in its place) and fails as Ray does ``failures`` times."""

    def __init__(self, failures, error=TIMED_OUT):
        self.failures, self.error, self.started = failures, error, []

    def __call__(self, **options):
        self.started.append(subprocess.Popen(["sleep", "60"]))
        if len(self.started) <= self.failures:
            raise self.error


@pytest.fixture
def fake_ray(monkeypatch):
    def use(init):
        monkeypatch.setattr(ray, "init", init)
        monkeypatch.setattr(ray, "shutdown", lambda: None)
        return init
    return use


def test_a_start_that_timed_out_is_tried_again_after_its_processes_are_gone(fake_ray):
    init = fake_ray(FlakyInit(failures=RAY_START_TRIES - 1))
    start_local_ray(address="local")
    assert len(init.started) == RAY_START_TRIES
    assert all(p.poll() is not None for p in init.started[:-1])      # gone (a 60 s sleep: killed)
    assert init.started[-1].poll() is None
    init.started[-1].kill()


def test_the_last_timeout_and_any_other_error_are_raised(fake_ray):
    init = fake_ray(FlakyInit(failures=RAY_START_TRIES))
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_ray(address="local")
    assert len(init.started) == RAY_START_TRIES
    other = fake_ray(FlakyInit(failures=1, error=ValueError("num_cpus must be positive")))
    with pytest.raises(ValueError, match="num_cpus"):
        start_local_ray(address="local")
    assert len(other.started) == 1
    for process in init.started + other.started:
        process.kill()

"""Rendezvous ports for local rank processes (rlcore.launch): free now, below the kernel's ephemeral range, and a port
something listens on is passed over."""
import socket

from rlcore import launch


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    for _ in range(20):
        port = launch.free_port()
        assert launch.LOWEST <= port < launch._ephemeral_low(), port
        with socket.socket() as s:
            s.bind(("", port))


def test_a_port_in_use_is_passed_over(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        free = launch.free_port()
        monkeypatch.setattr(launch._pick, "sample", lambda candidates, k: [taken, free])
        assert launch.free_port() == free


def test_torchrun_command_names_the_ranks_and_a_free_port():
    command = launch.torchrun(3)
    assert command[1:4] == ["-m", "torch.distributed.run", "--nproc_per_node=3"]
    port = int(command[4].removeprefix("--master_port="))
    assert launch.LOWEST <= port < launch._ephemeral_low()

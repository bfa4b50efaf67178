"""`rlcore diagnose` as a user runs it: on this machine (installed from the lock) the stack is as tested and the exit
status 0; in a scratch venv where Ray's installed metadata says another version, it names it and exits 1."""
import subprocess
import sys
import sysconfig
from pathlib import Path

from rlcore.diagnose import ESSENTIALS, ENGINES, essentials, stack_problems, tested_versions


def diagnose(*args, python=sys.executable):
    return subprocess.run([str(python), "-m", "rlcore.cli", "diagnose", *args], capture_output=True, text=True,
                          timeout=120)


def test_this_machine_is_as_tested():
    result = diagnose()
    assert result.returncode == 0, result.stdout + result.stderr
    stack = result.stdout.split("\nstack\n", 1)[1].split("\ndevices\n", 1)[0].splitlines()
    assert len(stack) == len(ESSENTIALS), stack
    for (label, _), line in zip(ESSENTIALS, stack):
        assert line.split()[0] == label and ("as tested" in line or (label in ENGINES and "not installed" in line)), \
            line
    assert "CUDA" in result.stdout and "host " in result.stdout and "grpo " in result.stdout
    assert result.stdout.rstrip().endswith("no problems: the stack is as tested"), result.stdout


def test_a_config_is_checked_and_estimated():
    result = diagnose("quickstart", "model.hf_config=qwen3-8b", "actor.parallel.tp=3", "trainer.world_size=3")
    assert "attention heads = 32 is not divisible by actor.parallel.tp = 3" in result.stderr, result.stderr
    assert "error: the config's parallel layout does not fit the model" in result.stdout
    assert result.returncode == 1
    fits = diagnose("qwen3-8b-gsm8k-8gpu")
    assert fits.returncode == 0 and "per device params" in fits.stdout and "CPU/node" in fits.stdout, \
        fits.stdout + fits.stderr


def test_a_mismatched_version_in_a_scratch_venv_is_named(tmp_path):
    """A venv that sees this one's packages (its site directory added, .pth files and all), in whose own
    site-packages pip would have left Ray 0.0.1's metadata: importlib.metadata finds that one first."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "shared_site.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    fake = site / "ray-0.0.1.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: ray\nVersion: 0.0.1\n")
    result = diagnose(python=python)
    tested = tested_versions()["ray"]
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"error: ray 0.0.1 is installed; rlcore was tested with {tested}: pip install 'ray=={tested}'" \
        in result.stdout, result.stdout
    assert sum(line.strip().startswith("error:") for line in result.stdout.splitlines()) == 1, result.stdout


def test_an_engine_is_needed_only_by_the_config_that_uses_it():
    pins = {"torch": "2.13.0", "sglang": "0.5.23"}
    rows = [row for row in essentials(pins) if row.label in ("torch", "SGLang")]
    missing = [row.__class__(row.label, None, None, row.tested) for row in rows]
    assert [str(p) for p in stack_problems(missing, pins, "vllm")] == [
        "error: torch is not installed; rlcore was tested with 2.13.0: pip install 'torch==2.13.0' (scripts/install.sh "
        "installs the tested stack from a checkout)"]
    assert "error: SGLang is not installed" in str(stack_problems(missing, pins, "sglang")[1])

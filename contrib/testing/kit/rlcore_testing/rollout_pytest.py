"""The rollout contract (``rlcore_testing.rollout``'s checks) as pytest tests: ``RolloutContract``, the class a
backend's test module subclasses, and the child process that hosts the engine when vLLM's one-engine-per-process rule
asks for it."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import multiprocessing
import traceback
from typing import Any, Callable

import pytest
import torch

from rlcore_testing.contract import LOGPROB_TOLERANCE, Contract, Factory, RegisteredBackend, build_contract
from rlcore_testing.rollout import CHECKS
from rlcore_testing.routed_experts import ROUTED_EXPERTS_CHECKS, build_moe_contract, moe_hf_config

_ALL_CHECKS = {**CHECKS, **ROUTED_EXPERTS_CHECKS}

# --------------------------------------------------------------------------------------------------------------------
# The contract in a child process: vLLM allows one in-process engine per process, and a test session may host one.

def _serve_checks(factory: Factory, path: str, tolerance: float, hf_config: dict | None, conn,
                  build: Callable[..., Contract] = build_contract) -> None:
    """Build the contract here, then run the checks the parent names, one at a time, until it sends None."""
    try:
        contract = build(factory, path, tolerance, hf_config)
        conn.send(("passed", ""))
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    while (name := conn.recv()) is not None:
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                _ALL_CHECKS[name](contract)
            conn.send(("passed", printed.getvalue()))
        except pytest.skip.Exception as skipped:
            conn.send(("skipped", str(skipped)))
        except BaseException:
            conn.send(("failed", printed.getvalue() + traceback.format_exc()))
    contract.engine.stop()


class ContractInChild:
    """The contract (engine, reference, prompts) in a spawned child process that runs the checks by name."""

    def __init__(self, factory: Factory, path: str, tolerance: float, hf_config: dict | None, timeout: float = 600,
                 build: Callable[..., Contract] = build_contract):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout = timeout
        self._process = ctx.Process(target=_serve_checks, args=(factory, path, tolerance, hf_config, child, build),
                                    daemon=True)
        self._process.start()
        child.close()
        self._answer("starting the engine")

    def run(self, check: str) -> None:
        self._conn.send(check)
        self._answer(check)

    def _answer(self, what: str) -> None:
        if not self._conn.poll(self._timeout):
            raise TimeoutError(f"the contract's process did not finish {what} within {self._timeout:g} s")
        try:
            status, text = self._conn.recv()
        except EOFError:
            self._process.join(10)
            raise RuntimeError(f"the contract's process died during {what} (exit code {self._process.exitcode})")
        print(text, end="")
        if status == "skipped":
            pytest.skip(text)
        if status == "failed":
            pytest.fail(f"in the contract's process, {what}:\n{text}", pytrace=False)

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._process.join(60)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _score_in_child(factory: Factory, path: str, sequences: list[list[int]], start: list[int], conn) -> None:
    engine = factory(path)
    try:
        conn.send(engine.score(sequences, start))
    finally:
        engine.stop()


def score_in_child(factory: Factory, path: str, sequences: list[list[int]], start: list[int]) -> list[list[float]]:
    """``factory(path)``'s ``score`` in a spawned child process (for a test session that may host an engine)."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_score_in_child, args=(factory, path, sequences, start, child), daemon=True)
    process.start()
    child.close()
    try:
        return conn.recv()
    except EOFError:
        process.join(10)
        raise RuntimeError(f"the scoring process died (exit code {process.exitcode}); its stderr says why") from None
    finally:
        process.join(60)


class RolloutContract:
    """Subclass it as ``Test<Backend>Contract`` and pytest runs one test per check (``test_<check>``) on one engine
    for the class, built by ``factory(model_path)`` (picklable when ``in_subprocess``: the engine, the reference and
    the checks then run in a child process). ``limitations``: {check: reason} for known, documented limitations, run
    as strict xfails; ``not_applicable``: {check: why} for checks of what the backend does not do here (releasing
    memory on CPU), not collected; a name that is no check is refused when the class is defined.
    ``test_routed_experts[<model>]`` runs ``routed_experts`` on an engine and a contract of its own per tiny MoE model
    of ``routed_experts_models`` (``rlcore_testing.rollout.MOE_MODELS``), where the backend declares routes on this
    machine's device type (``RolloutBackendSpec.routed_experts``; skipped elsewhere)."""
    factory: Factory
    in_subprocess: bool = False
    limitations: dict[str, str] = {}
    not_applicable: dict[str, str] = {}
    tolerance: float = LOGPROB_TOLERANCE
    hf_config: dict | None = None
    routed_experts_models: tuple[str, ...] = ("qwen3_moe",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for kind in ("limitations", "not_applicable"):
            unknown = set(getattr(cls, kind)) - set(_ALL_CHECKS)
            if unknown:
                raise KeyError(f"{cls.__name__}.{kind} names checks that do not exist: {sorted(unknown)} "
                               f"(checks: {sorted(_ALL_CHECKS)})")
        for name in cls.not_applicable:
            setattr(cls, f"test_{name}", None)     # not a test of this class: pytest collects no test_<name>

    @pytest.fixture(scope="class")
    def rollout_contract(self, tmp_path_factory):
        path = str(tmp_path_factory.mktemp("rollout-contract"))
        if self.in_subprocess:
            child = ContractInChild(self.factory, path, self.tolerance, self.hf_config)
            yield child
            child.close()
            return
        contract = build_contract(self.factory, path, self.tolerance, self.hf_config)
        yield contract
        contract.engine.stop()

    def pytest_generate_tests(self, metafunc) -> None:
        if "routed_experts_contract" in metafunc.fixturenames:
            metafunc.parametrize("routed_experts_contract", self.routed_experts_models, indirect=True, scope="class")

    @pytest.fixture(scope="class")
    def routed_experts_contract(self, request, tmp_path_factory):
        factory = _with_routes(self.factory)
        path = str(tmp_path_factory.mktemp(f"routed-experts-{request.param}"))
        hf_config = moe_hf_config(request.param)
        if self.in_subprocess:
            child = ContractInChild(factory, path, self.tolerance, hf_config, build=build_moe_contract)
            yield child
            child.close()
            return
        contract = build_moe_contract(factory, path, self.tolerance, hf_config)
        yield contract
        contract.engine.stop()

    def test_routed_experts(self, routed_experts_contract) -> None:
        if isinstance(routed_experts_contract, ContractInChild):
            routed_experts_contract.run("routed_experts")
        else:
            ROUTED_EXPERTS_CHECKS["routed_experts"](routed_experts_contract)
    test_routed_experts.__doc__ = ROUTED_EXPERTS_CHECKS["routed_experts"].__doc__

    @pytest.fixture(autouse=True)
    def _known_limitation(self, request):
        reason = self.limitations.get(request.node.originalname.removeprefix("test_"))
        if reason:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


def _with_routes(factory: Factory) -> Factory:
    """``factory`` started with routed experts; skips the test where the backend declares none on this device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(factory, RegisteredBackend):
        pytest.skip("the routed experts check starts its engine through a RegisteredBackend factory")
    declared = factory.spec().routed_experts
    if device not in declared:
        pytest.skip(f"rollout backend {factory.name!r} returns no routed experts on {device} "
                    f"(RolloutBackendSpec.routed_experts: {declared})")
    return dataclasses.replace(factory, routed_experts=True)


def _contract_test(name: str, check: Callable[[Contract], None]) -> Callable:
    def test(self, rollout_contract) -> None:
        if isinstance(rollout_contract, ContractInChild):
            rollout_contract.run(name)
        else:
            check(rollout_contract)
    test.__name__ = test.__qualname__ = f"test_{name}"
    test.__doc__ = check.__doc__
    return test


for _name, _check in CHECKS.items():
    setattr(RolloutContract, f"test_{_name}", _contract_test(_name, _check))

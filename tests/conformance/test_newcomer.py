"""A newcomer's tier joins without touching the others, and the conformance suite
says exactly what it lacks (issue 15)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from corral.spec import TIERS, SandboxSpec, tier_names
from corral.tiers import probe_all, tier_class

from .stub_tier import NAME, StubTier

HERE = Path(__file__).resolve().parent

#: what the conformance suite must report for the stub: None = passed, else the skip reason
EXPECTED = {
    "test_exit_codes": "tier stub lacks TierSandbox.start",
    "test_stdout_and_stderr_are_separate_and_streamed_in_order": "tier stub lacks TierSandbox.start",
    "test_files_in_and_out": "tier stub lacks TierSandbox.start",
    "test_workspace_is_mounted_and_written_back": "tier stub lacks TierSandbox.start",
    "test_a_workspace_link_that_climbs_through_another_link_is_not_written_back": "tier stub lacks TierSandbox.start",
    "test_write_back_leaves_the_hosts_git_configuration_and_hooks_as_they_were": "tier stub lacks TierSandbox.start",
    "test_env_is_passed_and_host_env_is_not": "tier stub lacks TierSandbox.start",
    "test_timeout_is_typed_and_sandbox_stays_usable": "tier stub lacks TierSandbox.start",
    "test_memory_limit_is_reported_as_oom": "tier stub lacks TierSandbox.start",
    "test_nothing_persists_between_sandboxes": None,
    "test_no_host_files_visible": "tier stub lacks TierSandbox.start",
    "test_teardown_leaves_nothing": "tier stub lacks TierSandbox.start",
}


def test_a_registered_tier_joins_without_touching_the_others() -> None:
    assert TIERS == ("process", "gvisor", "microvm", "wasm")  # the built-in list is untouched
    assert tier_names()[-1] == NAME
    assert tier_class(NAME) is StubTier
    assert SandboxSpec(tier=NAME).tier == NAME
    assert any(a.tier == NAME and a.available for a in probe_all(Path(os.environ["CORRAL_STATE_DIR"])))


def test_the_conformance_suite_reports_what_the_stub_lacks(tmp_path: Path) -> None:
    report = tmp_path / "report.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_conformance.py"),
         "-k", f"{NAME} and embedded", f"--junitxml={report}"],
        cwd=HERE.parents[1], capture_output=True, text=True, timeout=300,
        # its own state dir and cgroup parent (its conftest makes them, and removes them at the end)
        env={k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    outcome: dict[str, str | None] = {}
    for case in ET.parse(report).iter("testcase"):
        name = case.attrib["name"]
        assert name.endswith(f"[{NAME}-embedded]"), name
        assert case.find("failure") is None and case.find("error") is None, ET.tostring(case).decode()
        skipped = case.find("skipped")
        outcome[name.removesuffix(f"[{NAME}-embedded]")] = None if skipped is None else skipped.attrib["message"]
    assert outcome == EXPECTED

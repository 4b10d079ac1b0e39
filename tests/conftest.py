"""Shared fixtures, and the stack every test ran on (``tests/stacks.py``), named at the start and the end of a run."""

from __future__ import annotations

from tests import stacks


def pytest_report_header(config):
    return stacks.describe()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = {key: len(terminalreporter.stats.get(key, [])) for key in ("passed", "failed", "error", "skipped")}
    ran = ", ".join(f"{count} {key}" for key, count in counts.items() if count)
    terminalreporter.write_line(f"{stacks.describe()}: {ran or 'no tests ran'}")

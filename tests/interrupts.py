"""Interrupting a command as a user's Ctrl-C does, whatever the test runner was started from.

A shell starts background jobs (``make test &``, ``nohup ... &``) with SIGINT ignored, children inherit that, and
Python then keeps SIGINT ignored instead of raising ``KeyboardInterrupt``: a SIGINT sent to such a command does
nothing. A terminal's Ctrl-C reaches a foreground command whose SIGINT is the default, so the commands these
tests interrupt are started that way.
"""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """``preexec_fn`` for ``subprocess.Popen``: the child starts with SIGINT's default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

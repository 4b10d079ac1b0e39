"""Importing this module turns verl_cppack on inside verl (``verl_cppack.integrations.verl.install()``).

Use it as verl's external library, so every worker imports it::

    actor_rollout_ref.model.external_lib=verl_cppack.verl_plugin      # the critic follows the actor's model
    VERL_USE_EXTERNAL_MODULES=verl_cppack.verl_plugin                 # or through the environment

It imports nothing of verl or megatron (verl's util module is patched when it loads); ``VERL_CPPACK_DISABLE=1``
leaves verl untouched. With ``VERL_PLATFORM=cpu`` it also arms the CPU runtime (``verl_cppack.runtime``)."""

import importlib.util

if importlib.util.find_spec("verl") is None:  # also true while verl/__init__ runs: verl is in sys.modules then
    raise ImportError(
        "verl_cppack.verl_plugin patches verl, which is not installed in this Python environment: "
        "pip install 'verl-cppack[verl]' (verl 0.6.1 to 0.9.1 are tested), or import verl_cppack for the core alone"
    )

from verl_cppack import runtime  # noqa: E402 - after the check, so that a missing verl fails first and alone
from verl_cppack.integrations.verl.patching import install, status, uninstall  # noqa: E402

INSTALLED = install()
CPU_SUPPORT = runtime.activate_if_requested()

__all__ = ["CPU_SUPPORT", "INSTALLED", "install", "status", "uninstall"]

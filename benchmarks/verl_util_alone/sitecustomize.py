"""verl's ``verl.models.mcore.util`` where verl's stack cannot be installed: a measuring aid, not part of the package.

``import verl`` imports Ray (``verl.protocol``), tensordict and the rest of verl's stack. On a machine that has none of
them and cannot fetch them (the GPU machine the figures in docs/performance.md, "On a GPU", come from), this module —
found by Python at start-up as ``sitecustomize`` when its folder is first on ``PYTHONPATH`` — registers verl's
packages without running their ``__init__`` files, so that ``verl.models.mcore.util`` is verl's own file, unchanged,
loaded from ``$VERL_SITE`` (the folder that holds an unpacked verl wheel's ``verl/``). The only two verl imports of
that file that the pack/unpack functions never use are stubbed: ``verl.utils.device.is_npu_available`` (False: a
CUDA machine) and ``verl.utils.model.CausalLMOutputForPPO`` (verl's model forwards' output class). Without
``VERL_SITE`` it does nothing. Usage, with megatron-core installed::

    VERL_SITE=/path/to/site PYTHONPATH=benchmarks/verl_util_alone:/path/to/site:. \\
        python -m verl_cppack.cli bench --device cuda --cp-sizes 1
"""

import os
import sys
import types

_SITE = os.environ.get("VERL_SITE")


def _register(name: str, *path: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = [os.path.join(_SITE, *path)]
    sys.modules[name] = module
    return module


if _SITE:
    _register("verl", "verl")
    _register("verl.models", "verl", "models")
    _register("verl.models.mcore", "verl", "models", "mcore")
    _register("verl.utils", "verl", "utils")
    _device = types.ModuleType("verl.utils.device")
    _device.is_npu_available = False
    sys.modules["verl.utils.device"] = _device
    _model = types.ModuleType("verl.utils.model")

    class CausalLMOutputForPPO:  # the output class of verl's model forwards, which are never called here
        pass

    _model.CausalLMOutputForPPO = CausalLMOutputForPPO
    sys.modules["verl.utils.model"] = _model

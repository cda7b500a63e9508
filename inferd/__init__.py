"""inferd: an LLM inference serving platform."""

from inferd.cpu import cap_torch
from inferd.errors import InferdError
from inferd.sampling import SamplingParams

cap_torch()  # INFERD_MAX_CPU_ISA reaches torch's kernels before their first use

__all__ = ["LLM", "InferdError", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the models; import it lazily so `import inferd` stays cheap.
    if name == "LLM":
        from inferd.engine.engine import LLM

        return LLM
    raise AttributeError(name)

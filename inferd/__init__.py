"""inferd: an LLM inference serving platform."""

from inferd.errors import InferdError
from inferd.sampling import SamplingParams

__all__ = ["LLM", "InferdError", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the models; import it lazily so `import inferd` stays cheap.
    if name == "LLM":
        from inferd.engine.engine import LLM

        return LLM
    raise AttributeError(name)

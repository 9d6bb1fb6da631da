"""Names outside torch's and megatron-core's public API that the modules of core.ssm read.

Each module that reads such names lists them in its ``PRIVATE_NAMES``; tests/ssm checks every
entry against the installed torch and megatron-core, so a release that moves one fails a test
that names the release and the module relying on it, not a training run."""

from typing import NamedTuple


class PrivateName(NamedTuple):
    """``owner.attribute``, a name of the distribution ``package`` ("torch", "megatron-core").

    ``owner`` is the dotted path of a module or of a class. On a class, ``attribute`` may also
    be one that the class declares for its instances (an annotation) or sets in its code
    (``obj.attribute = ...``, ``setattr(obj, "attribute", ...)``), on itself or on the objects
    it manages (Megatron-FSDP marks parameters that way)."""

    package: str
    owner: str
    attribute: str

    def __str__(self) -> str:
        return f"{self.owner}.{self.attribute}"

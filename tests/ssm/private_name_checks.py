"""Checks a name that a module of core.ssm declares in its ``PRIVATE_NAMES`` against the
installed torch or megatron-core: a name that moved gives a message naming the release and the
module that relies on it."""

import importlib
import importlib.metadata
import inspect
import re
from types import ModuleType
from typing import Optional

from core.ssm.private_names import PrivateName


def _owner(path: str):
    """The module or class at the dotted ``path``, or None."""
    try:
        return importlib.import_module(path)
    except ImportError:
        pass
    module_path, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_path), name, None)
    except ImportError:
        return None


def _declared_or_set(cls: type, attribute: str) -> bool:
    """``cls`` (or a base) annotates ``attribute``, or its code sets it on some object."""
    if any(attribute in inspect.get_annotations(base) for base in cls.__mro__):
        return True
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    name = re.escape(attribute)
    return re.search(rf"\.{name}\s*(:[^=\n]*)?=(?!=)|setattr\([^,()]+,\s*['\"]{name}['\"]",
                     source) is not None


def private_name_problem(private: PrivateName, user: ModuleType) -> Optional[str]:
    """None when the installed ``private.package`` still has ``private``, else the message."""
    relies = f"{user.__name__.replace('.', '/')}.py relies on it"
    release = f"{private.package} {importlib.metadata.version(private.package)}"
    owner = _owner(private.owner)
    if owner is None:
        return f"{release} no longer has {private.owner} (for {private.attribute}); {relies}"
    if hasattr(owner, private.attribute):
        return None
    if inspect.isclass(owner) and _declared_or_set(owner, private.attribute):
        return None
    return f"{release} no longer has {private}; {relies}"

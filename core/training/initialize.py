"""What megatron's ``initialize_megatron`` needs from an installed megatron-core wheel."""

from __future__ import annotations

import os


def use_prebuilt_dataset_helpers() -> None:
    """Let ``initialize_megatron`` run from the megatron-core wheel. It runs ``make`` in
    ``megatron/core/datasets`` to build the C++ dataset helpers; the wheel ships them prebuilt
    (``helpers_cpp``) but without the Makefile, so ``make`` fails and megatron exits. After this
    call, megatron's ``compile_helpers`` imports the prebuilt module when there is no Makefile
    and builds as before in a source checkout. Call it before ``pretrain`` /
    ``initialize_megatron``; calling it again changes nothing."""
    import megatron.core.datasets.utils as dataset_utils

    compile_helpers = dataset_utils.compile_helpers
    if getattr(compile_helpers, "imports_prebuilt_helpers", False):
        return
    makefile = os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")

    def compile_or_import_helpers():
        if os.path.exists(makefile):
            return compile_helpers()
        from megatron.core.datasets import helpers_cpp  # noqa: F401  (the wheel's build)

    compile_or_import_helpers.imports_prebuilt_helpers = True
    dataset_utils.compile_helpers = compile_or_import_helpers

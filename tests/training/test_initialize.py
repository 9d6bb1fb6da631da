"""core.training.use_prebuilt_dataset_helpers: megatron's compile_helpers imports the wheel's
prebuilt dataset helpers where there is no Makefile, and runs make where there is one."""

import megatron.core.datasets.utils as dataset_utils
import pytest

from core.training import use_prebuilt_dataset_helpers


@pytest.fixture
def compile_helpers(monkeypatch):
    """megatron's compile_helpers replaced by a recorder (it would run make); restored after."""
    calls = []
    monkeypatch.setattr(dataset_utils, "compile_helpers", lambda: calls.append("make"))
    return calls


def test_the_wheel_has_prebuilt_helpers_and_no_makefile():
    import os

    here = os.path.dirname(dataset_utils.__file__)
    assert not os.path.exists(os.path.join(here, "Makefile"))
    assert any(name.startswith("helpers_cpp") for name in os.listdir(here))


def test_without_a_makefile_the_prebuilt_module_is_imported(compile_helpers):
    use_prebuilt_dataset_helpers()
    use_prebuilt_dataset_helpers()  # again: still one wrapper
    assert dataset_utils.compile_helpers.imports_prebuilt_helpers
    dataset_utils.compile_helpers()
    assert compile_helpers == []
    from megatron.core.datasets import helpers_cpp

    assert hasattr(helpers_cpp, "build_sample_idx_int64")


def test_with_a_makefile_megatron_builds_as_before(compile_helpers, monkeypatch):
    import os

    use_prebuilt_dataset_helpers()
    makefile = os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")
    asked = []
    monkeypatch.setattr("os.path.exists", lambda path: asked.append(path) or path == makefile)
    dataset_utils.compile_helpers()
    assert compile_helpers == ["make"] and asked == [makefile]  # megatron's own Makefile
